"""`sft report <sweep dir> [--baseline SETTING]`: a sweep's report rebuilt (`sft.experiments.report`), its page
(`report.html`) with it; `sft report <run dir | sweep dir> --html`: only the page (`sft.experiments.pages`), printed
where it was written."""

from __future__ import annotations

import sys
from pathlib import Path

from sft.experiments.report import ReportError, job_dirs, write_report


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="sft report", description="Rebuild a sweep's report, or a run's or a "
                                     "sweep's page.")
    parser.add_argument("dir", help="a sweep dir (its jobs' dirs inside), or with --html a run dir")
    parser.add_argument("--baseline", default=None, help='the setting to compare with, e.g. "loss.alpha=0"')
    parser.add_argument("--html", action="store_true", help="write report.html only (one file: no server, no "
                        "network) and print its path")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    folder = Path(args.dir)
    if not folder.is_dir():
        parser.error(f"{args.dir} is not a directory")
    try:
        if args.html:
            print(write_page(folder, args.baseline))
            return
        rows = write_report(folder, args.baseline)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # a full disk, a read-only dir
        print(f"error: the report cannot be written into {args.dir}: {e.strerror} ({e.filename})", file=sys.stderr)
        sys.exit(1)
    if not rows:
        print(f"error: no job dirs in {args.dir}", file=sys.stderr)
        sys.exit(2)
    print((folder / "sweep_summary.md").read_text())


def write_page(folder: Path, baseline: str | None = None) -> Path:
    """A sweep's page where the dir holds jobs, else a run's."""
    from sft.experiments.pages import write_run_page
    from sft.experiments.report import write_page as write_sweep_page
    from sft.run.recipe import recipe_or_none

    if job_dirs(folder):
        return write_sweep_page(folder, baseline)
    return write_run_page(folder, recipe_or_none(folder))


if __name__ == "__main__":
    main()
