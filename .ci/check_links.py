#!/usr/bin/env python3
"""Checks the links of a built mdBook and of Markdown files, without the network.

Usage: check_links.py BOOK_DIR [FILE.md ...]

- In every HTML page of BOOK_DIR: each relative href/src must name a file that exists, and a
  `#fragment` must be an id (or name) in the page it points into.
- In each Markdown file: each inline link `[text](target)` outside code must name a file that
  exists (relative to the Markdown file), and a `#fragment` must be a heading of the target
  Markdown file (GitHub's anchors) or an id of the target HTML page.
- External links (http, https) are listed, not fetched. mailto: links are skipped.

Exits 1 when a link is broken, 2 on bad usage.
"""

from __future__ import annotations

import html.parser
import os
import re
import sys
import urllib.parse

EXTERNAL = ("http://", "https://")
SKIPPED = ("mailto:", "javascript:", "data:")


class Page(html.parser.HTMLParser):
    """The links and the ids of one HTML page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.links: list[tuple[int, str]] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name in ("id", "name") and tag != "meta":
                self.ids.add(value)
            if (name == "href" and tag in ("a", "link")) or (name == "src" and tag in ("img", "script")):
                self.links.append((self.getpos()[0], value))


_pages: dict[str, Page] = {}


def page(path: str) -> Page:
    if path not in _pages:
        p = Page()
        with open(path, encoding="utf-8") as f:
            p.feed(f.read())
        _pages[path] = p
    return _pages[path]


def github_anchor(heading: str) -> str:
    """The anchor GitHub (and, near enough, mdBook) gives a Markdown heading."""
    text = re.sub(r"`|\*\*|\*|_(?=\w)|(?<=\w)_", "", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def markdown_lines(path: str):
    """(line number, text) of the lines of a Markdown file outside fenced code blocks."""
    fence = None
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            stripped = line.lstrip()
            if fence is None and (stripped.startswith("```") or stripped.startswith("~~~")):
                fence = stripped[:3]
                continue
            if fence is not None:
                if stripped.startswith(fence):
                    fence = None
                continue
            yield number, line


_anchors: dict[str, set[str]] = {}


def markdown_anchors(path: str) -> set[str]:
    if path not in _anchors:
        seen: dict[str, int] = {}
        anchors = set()
        for _, line in markdown_lines(path):
            m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
            if not m:
                continue
            slug = github_anchor(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
        for _, line in markdown_lines(path):
            anchors.update(re.findall(r'<a\s+(?:id|name)="([^"]+)"', line))
        _anchors[path] = anchors
    return _anchors[path]


def check_target(source: str, base_dir: str, target: str, problems: list[str], external: set[str]) -> None:
    if target.startswith(EXTERNAL):
        external.add(target)
        return
    if target.startswith(SKIPPED) or target == "":
        return
    parsed = urllib.parse.urlsplit(target)
    if parsed.scheme or parsed.netloc:
        problems.append(f"{source}: unsupported link {target!r}")
        return
    path = urllib.parse.unquote(parsed.path)
    fragment = urllib.parse.unquote(parsed.fragment)
    if path.startswith("/"):
        problems.append(f"{source}: absolute link {target!r} (use a relative one)")
        return
    resolved = os.path.normpath(os.path.join(base_dir, path)) if path else None
    if resolved is None:
        resolved = source.split(":")[0]
    if os.path.isdir(resolved):
        index = os.path.join(resolved, "index.html")
        if os.path.exists(index):
            resolved = index
        elif fragment:
            problems.append(f"{source}: {target!r} has an anchor but names a directory")
            return
    if not os.path.exists(resolved):
        problems.append(f"{source}: {target!r}: no such file ({resolved})")
        return
    if not fragment:
        return
    if resolved.endswith(".html"):
        ids = page(resolved).ids
    elif resolved.endswith(".md"):
        ids = markdown_anchors(resolved)
    else:
        problems.append(f"{source}: {target!r}: an anchor into a file that has none")
        return
    if fragment not in ids:
        problems.append(f"{source}: {target!r}: no anchor #{fragment} in {resolved}")


def check_book(book: str, problems: list[str], external: set[str]) -> int:
    count = 0
    for root, _, files in os.walk(book):
        for name in sorted(files):
            # 404.html links with the site's absolute root (mdBook's `site-url`), which only
            # means something once deployed.
            if not name.endswith(".html") or (root == book and name == "404.html"):
                continue
            path = os.path.join(root, name)
            for line, target in page(path).links:
                count += 1
                check_target(f"{path}:{line}", root, target, problems, external)
    return count


INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")


def check_markdown(path: str, problems: list[str], external: set[str]) -> int:
    count = 0
    base = os.path.dirname(path) or "."
    for number, line in markdown_lines(path):
        code_free = re.sub(r"`[^`]*`", "", line)
        for target in INLINE_LINK.findall(code_free):
            count += 1
            check_target(f"{path}:{number}", base, target, problems, external)
    return count


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    book, markdown = argv[1], argv[2:]
    if not os.path.isdir(book):
        print(f"check_links: {book} is not a directory (build the book first)", file=sys.stderr)
        return 2
    problems: list[str] = []
    external: set[str] = set()
    checked = check_book(book, problems, external)
    for path in markdown:
        checked += check_markdown(path, problems, external)
    if external:
        print(f"check_links: {len(external)} external links, not fetched:")
        for url in sorted(external):
            print(f"  {url}")
    if problems:
        print(f"check_links: {len(problems)} broken of {checked} links:", file=sys.stderr)
        for p in problems:
            print(f"  {p}", file=sys.stderr)
        return 1
    print(f"check_links: {checked} links checked, none broken")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
