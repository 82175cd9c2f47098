"""Writing a tool's outputs: ``<stem>.md`` and ``<stem>.json`` in one folder."""

from __future__ import annotations

import json
import os
import subprocess


def git_commit() -> str:
    """The commit measured: ``K3PALLAS_GIT_COMMIT`` (runs from a copy of the tree without .git,
    as on the GPU machine), else git's short HEAD, else ''."""
    commit = os.environ.get("K3PALLAS_GIT_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, cwd=os.path.dirname(__file__),
                                    timeout=10).stdout.strip()
        except Exception:  # noqa: BLE001 - the commit is informative only
            commit = ""
    return commit


def write_report(out_dir: str, stem: str, markdown: str, data) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(markdown + "\n")
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(data, f, indent=1)
