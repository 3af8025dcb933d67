"""The docs where users look: the README is the front door (under 10 KB, its links resolve, its index names
every page), the site builds with `mkdocs build --strict` (a broken link, anchor or a page missing from the
navigation fails), and every example folder is on the examples page."""

import os
import re
import subprocess
import sys

from conftest import REPO

README = REPO / "README.md"


def test_the_readme_is_under_10_kb_and_every_link_resolves():
    text = README.read_text()
    assert len(text.encode()) < 10_000, len(text.encode())
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert links and all((REPO / link).exists() for link in links if "://" not in link), links
    pages = {p.name for p in (REPO / "docs").glob("*.md")} - {"index.md"}
    assert pages <= {link.removeprefix("docs/") for link in links}  # the index names every page


def test_the_site_builds_strictly(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "site" / "architecture" / "index.html").is_file()


def test_every_example_is_on_the_examples_page():
    page = (REPO / "docs" / "examples.md").read_text()
    folders = [p.name for p in (REPO / "examples").iterdir() if (p / "README.md").is_file()]
    assert len(folders) == 12 and all(f"`{name}/`" in page for name in folders)


def test_every_link_and_docs_path_of_the_examples_readmes_resolves():
    """mkdocs checks docs/ only: the examples' READMEs are checked here, Markdown links and docs/... paths alike."""
    for readme in (REPO / "examples").glob("*/README.md"):
        text = readme.read_text()
        for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            assert "://" in link or (readme.parent / link).exists(), (readme, link)
        for path in re.findall(r"\bdocs/[\w/.-]+\.md", text):
            assert (REPO / path).exists(), (readme, path)


def test_every_error_the_docs_quote_is_the_codes_own_word_for_word(capsys):
    """A page's "`overrides` → `error: ...`" is what `python -m sft.train overrides --check` prints."""
    from sft.config.argv import check_only

    quoted = [(page.name, overrides, " ".join(error.split()))
              for page in sorted((REPO / "docs").glob("*.md"))
              for overrides, error in re.findall(r"`([^`\n]+)` →\s+`(error: [^`]+)`", page.read_text())]
    assert len(quoted) >= 4
    for page, overrides, error in quoted:
        assert check_only(overrides.split()) == 2, (page, overrides)
        assert capsys.readouterr().err.strip() == error, (page, overrides)
