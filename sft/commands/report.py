"""`sft report <sweep dir> [--baseline SETTING]`: a sweep's report rebuilt (`sft.experiments.report`)."""

from __future__ import annotations

import sys
from pathlib import Path

from sft.experiments.report import ReportError, write_report


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="sft report", description="Rebuild a sweep's report.")
    parser.add_argument("sweep_dir")
    parser.add_argument("--baseline", default=None, help='the setting to compare with, e.g. "loss.alpha=0"')
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not Path(args.sweep_dir).is_dir():
        parser.error(f"{args.sweep_dir} is not a directory")
    try:
        rows = write_report(args.sweep_dir, args.baseline)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # a full disk, a read-only dir
        print(f"error: the report cannot be written into {args.sweep_dir}: {e.strerror} ({e.filename})", file=sys.stderr)
        sys.exit(1)
    if not rows:
        print(f"error: no job dirs in {args.sweep_dir}", file=sys.stderr)
        sys.exit(2)
    print((Path(args.sweep_dir) / "sweep_summary.md").read_text())



if __name__ == "__main__":
    main()
