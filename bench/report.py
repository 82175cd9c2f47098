"""Writing a tool's outputs: ``<stem>.md`` and ``<stem>.json`` in one folder."""

from __future__ import annotations

import json
import os


def write_report(out_dir: str, stem: str, markdown: str, data) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(markdown + "\n")
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(data, f, indent=1)
