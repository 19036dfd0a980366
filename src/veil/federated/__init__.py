"""Federated learning with differential privacy, on Flower (the optional extra ``veil[federated]``).

Two guarantees, two modes:

* **client-level** (DP-FedAvg, McMahan et al. 2018): neighbouring federations differ by one whole
  client (add/remove-one client). Each round veil Poisson-samples the clients itself (each node joins
  with probability q, independently: Flower's fraction-based selection draws a fixed-size sample,
  which the accountant's q would not describe), clips every client's model update to L2 norm C on
  the server, sums the clipped updates and adds ``N(0, σ²C²)`` once, then divides by the *expected*
  number of clients qN (a public constant: dividing by the realised count would release it). One
  round is the event ``PoissonSampled(q, Gaussian(σ))``; σ is calibrated by veil's accountant for the
  target ε over the planned rounds, and the ledger is charged before each round's aggregate exists.
* **record-level** across silos: neighbouring datasets differ by one record of one silo. Each silo
  trains with veil's DP-SGD engine on its own data and accounts its own ε; the silos hold disjoint
  records, so by parallel composition the global model's record-level ε is the largest silo's ε.
  With ``--privacy-unit COLUMN`` the record is a person: every row of a person lies in one silo and
  each silo runs unit-level DP-SGD (:mod:`.units`).

Modules: :mod:`.settings` (the run's settings, flat for Flower's run config), :mod:`.partition`
(data over clients), :mod:`.privacy` (calibration and accounting), :mod:`.aggregate` (clip, sum,
noise), :mod:`.local` (what a client computes, torch), :mod:`.strategy` / :mod:`.apps` (Flower),
:mod:`.run` (the job: simulation or deployment, then the report), :mod:`.charge` (what the run
charges its dataset in the budget registry, and why that bounds one row). Importing this package loads
neither Flower nor torch.
"""
