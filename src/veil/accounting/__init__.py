"""Privacy accounting: events, accountants (RDP, PLD), calibration, the run ledger. No torch here."""
