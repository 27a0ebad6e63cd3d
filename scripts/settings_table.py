"""Print the README's settings table from the Settings dataclass (one source of truth).

    python scripts/settings_table.py

tests/test_readme.py fails when the README's table differs from this output.
"""

from __future__ import annotations

from dataclasses import fields

from tokembed.server.process.settings import ENV_PREFIX, Settings, shown


def settings_table() -> str:
    rows = [
        "| flag | environment variable | default | meaning |",
        "|---|---|---|---|",
    ]
    for spec in fields(Settings):
        flag = "--" + spec.name.replace("_", "-")
        env = ENV_PREFIX + spec.name.upper()
        default = shown(spec.default)
        default = default if default == "unset" else f"`{default}`"
        meaning = str(spec.metadata["help"]).replace("|", "\\|")
        rows.append(f"| `{flag}` | `{env}` | {default} | {meaning} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(settings_table(), end="")
