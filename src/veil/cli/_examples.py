"""One worked example per command, shown at the foot of its ``--help`` page.

Kept in one table (rather than in each subcommand module) so that every help page gets one and a test
can check that none is missing: :func:`attach` sets them on the built application. Each example runs
as written on the built-in digits data or the small files the README's examples create.
"""

from __future__ import annotations

from typing import Any

# Command path (a subcommand of a group is "group sub") -> example lines.
EXAMPLES: dict[str, tuple[str, ...]] = {
    "": ("veil train --dataset digits --epsilon 3", "veil train --help"),
    "train": (
        "veil train --dataset digits --epsilon 3 --out runs/digits",
        "veil train --dataset csv:data.csv --schema schema.toml --epsilon 1",
    ),
    "epsilon": (
        "veil epsilon --batch-size 256 --dataset-size 60000 --epochs 60 --noise-multiplier 1.1 --delta 1e-5",
    ),
    "calibrate": ("veil calibrate --epsilon 3 --sampling-rate 0.004267 --steps 14063 --delta 1e-5",),
    "pate": ("veil pate --dataset digits --teachers 50 --epsilon 2",),
    "audit": ("veil audit --dataset digits --epsilon 3 --attack loss",),
    "schema": ("veil schema infer data.csv --target outcome --out schema.toml",),
    "schema infer": (
        "veil schema infer data.csv --target outcome --out schema.toml",
        "veil schema infer data.csv --target outcome --out dp.toml --epsilon 1",
    ),
    "schema check": ("veil schema check schema.toml --dataset csv:data.csv",),
    "predict": ("veil predict runs/data --dataset csv:new_rows.csv --out predictions.csv",),
    "synth": ("veil synth --dataset csv:data.csv --schema schema.toml --epsilon 1 --rows 500 --out syn",),
    "tune": ("veil tune --dataset csv:data.csv --schema schema.toml --epsilon 3 --out runs/tuned",),
    "federated": (
        "veil federated --mode client-level --dataset digits --clients 200 --rounds 20 --epsilon 3",
    ),
    "budget": ("veil budget set --dataset csv:data.csv --epsilon 4 --delta 1e-6",),
    "budget set": ("veil budget set --dataset csv:data.csv --epsilon 4 --delta 1e-6",),
    "budget show": ("veil budget show", "veil budget show --dataset csv:data.csv --json"),
    "budget report": ("veil budget report --out dpo-report",),
    "env": ("veil env --json",),
}


def epilog(path: str) -> str | None:
    """The help-page footer of the command at ``path`` (None when it has no example)."""
    lines = EXAMPLES.get(path)
    if not lines:
        return None
    # Typer's rich help joins the lines of one paragraph; a blank line between them keeps each apart.
    return "Example:\n\n" + "\n\n".join(f"  {line}" for line in lines)


def attach(app: Any, prefix: str = "") -> None:
    """Set the example of every command and group registered on the typer ``app`` (recursively)."""
    for command in app.registered_commands:
        name = command.name or (command.callback.__name__ if command.callback else "")
        path = f"{prefix} {name}".strip()
        if _unset(command.epilog):
            command.epilog = epilog(path)
    for group in app.registered_groups:
        sub = group.typer_instance
        path = f"{prefix} {group.name or sub.info.name}".strip()
        if _unset(group.epilog) and _unset(sub.info.epilog):
            group.epilog = epilog(path)
        attach(sub, path)


def _unset(value: Any) -> bool:
    """Whether typer holds no value of its own there (None, or its "default" placeholder)."""
    return value is None or type(value).__name__ == "DefaultPlaceholder"
