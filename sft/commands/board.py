"""`sft board [dirs...] [--port 8008] [--host 127.0.0.1]`: the pages of every run and sweep under the given dirs
(default: `outputs` and `multirun`), served by the standard library's HTTP server.

- `/`: an index, newest first: each run's and sweep's dir, when it last changed, its status;
- `/r<k>/<dir below the k-th given dir>/report.html`: that run's or sweep's page (`sft.experiments.pages`), made
  from its dir when asked, so that a run still writing shows its latest logs (its page then reloads itself every
  10 s); a sweep's links to its jobs' pages work as in the files.

Read-only (GET and HEAD only), on 127.0.0.1 unless `--host` says otherwise; a path outside the given dirs is refused
(403), whatever it is made of (`..`, links).
"""

from __future__ import annotations

import argparse
import html
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

from sft.experiments.pages import PAGE

REFRESH_S = 10  # a run that has not ended reloads its page this often


def kind_of(folder: Path) -> str | None:
    """`sweep` for a dir holding numbered job dirs, `run` for a run's dir (its `.hydra/` or `metrics.jsonl`)."""
    if any(p.is_dir() and p.name.isdigit() and (p / ".hydra").is_dir() for p in folder.iterdir()):
        return "sweep"
    if (folder / ".hydra" / "config.yaml").is_file() or (folder / "metrics.jsonl").is_file():
        return "run"
    return None


def found(roots: list[Path]) -> list[tuple[int, Path, str]]:
    """(root index, dir, kind) of every run and sweep below the roots (a sweep's jobs are on its page), newest first."""
    out = []
    for k, root in enumerate(roots):
        for folder in [root, *sorted(p for p in root.rglob("*") if p.is_dir())]:
            if any(parent in {f for _, f, kind in out if kind == "sweep"} for parent in folder.parents):
                continue
            kind = kind_of(folder)
            if kind:
                out.append((k, folder, kind))
    return sorted(out, key=lambda item: -changed(item[1]))


def changed(folder: Path) -> float:
    files = [p for p in (folder / "metrics.jsonl", folder / "results.json", folder / "sweep_summary.md",
                         folder / ".hydra" / "config.yaml") if p.is_file()]
    return max((p.stat().st_mtime for p in files), default=folder.stat().st_mtime)


def index(roots: list[Path]) -> str:
    from sft.experiments.results import RunResults

    rows = []
    for k, folder, kind in found(roots):
        rel = folder.relative_to(roots[k]).as_posix()
        href = f"/r{k}/{rel + '/' if rel != '.' else ''}{PAGE}"
        results = RunResults.read(folder) if kind == "run" else None
        status = results.status if results else ("running or interrupted" if kind == "run" else "sweep")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(changed(folder)))
        rows.append(f"<tr><td>{kind}</td><td><a href=\"{html.escape(href)}\">{html.escape(str(folder))}</a></td>"
                    f"<td>{when}</td><td>{html.escape(status)}</td></tr>")
    body = "\n".join(rows) or "<tr><td colspan=4>no run or sweep here yet</td></tr>"
    return ("<!doctype html><html><head><meta charset=\"utf-8\"><title>sft board</title>"
            f"<meta http-equiv=\"refresh\" content=\"{REFRESH_S}\"></head><body style=\"font-family:sans-serif\">"
            f"<h1>sft board</h1><p>{html.escape(', '.join(map(str, roots)))}</p><table border=1 cellpadding=4>"
            f"<tr><th>kind</th><th>dir</th><th>changed</th><th>status</th></tr>{body}</table></body></html>")


def resolve(roots: list[Path], path: str) -> Path | None:
    """The dir a page's URL path names (`/r<k>/<dir>/report.html`) where it lies inside the k-th root, else None."""
    parts = unquote(path).strip("/").split("/")
    if len(parts) < 2 or parts[-1] != PAGE or not parts[0].startswith("r") or not parts[0][1:].isdigit():
        return None
    k = int(parts[0][1:])
    if k >= len(roots):
        return None
    folder = (roots[k] / "/".join(parts[1:-1])).resolve()
    return folder if folder.is_relative_to(roots[k]) and folder.is_dir() else None


def page_of(folder: Path) -> str:
    from sft.experiments.pages import run_page
    from sft.experiments.report import sweep_page
    from sft.run.recipe import recipe_or_none

    if kind_of(folder) == "sweep":
        return sweep_page(folder)
    text = run_page(folder, recipe_or_none(folder))
    if not (folder / "results.json").is_file():  # still running: the page follows its logs
        text = text.replace("<head>", f"<head><meta http-equiv=\"refresh\" content=\"{REFRESH_S}\">", 1)
    return text


def handler(roots: list[Path]):
    class Board(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the standard library's name
            path = urlparse(self.path).path
            if path in ("/", "/index.html"):
                return self.reply(200, index(roots))
            folder = resolve(roots, path)
            if folder is None or kind_of(folder) is None:
                return self.reply(403, "<p>not a page of the runs and sweeps served here</p>")
            return self.reply(200, page_of(folder))

        def do_HEAD(self):  # noqa: N802
            self.do_GET()

        def do_POST(self):  # noqa: N802 - read-only
            self.reply(405, "<p>read-only</p>")

        do_PUT = do_DELETE = do_PATCH = do_POST

        def reply(self, code: int, text: str) -> None:
            body = text.encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def log_message(self, format, *args):  # noqa: A002 - one short line a request, to stderr
            sys.stderr.write(f"board: {self.address_string()} {format % args}\n")

    return Board


def serve(roots: list[Path], host: str = "127.0.0.1", port: int = 8008) -> ThreadingHTTPServer:
    """The board's server, bound (port 0: any free one); `serve_forever()` runs it."""
    return ThreadingHTTPServer((host, port), handler([r.resolve() for r in roots]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="sft board", description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="*", default=["outputs", "multirun"], help="where runs and sweeps are")
    parser.add_argument("--port", type=int, default=8008)
    parser.add_argument("--host", default="127.0.0.1", help="the address to bind (127.0.0.1: this machine only)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    roots = [Path(d) for d in args.dirs if Path(d).is_dir()]
    if not roots:
        print(f"error: none of {', '.join(args.dirs)} is a directory", file=sys.stderr)
        sys.exit(2)
    server = serve(roots, args.host, args.port)
    print(f"sft board: http://{args.host}:{server.server_address[1]}/ ({', '.join(map(str, roots))}); Ctrl-C stops",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
