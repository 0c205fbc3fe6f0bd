"""MkDocs hooks: the site's home page is the repository's README.md, its links made relative to docs/."""
import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri != "index.md":
        return markdown
    text = README.read_text(encoding="utf-8")
    text = text.replace("](docs/", "](")
    text = re.sub(r"\[LICENSE\]\(LICENSE\)", "the `LICENSE` file", text)
    text = re.sub(r"\[NOTICE\]\(NOTICE\)", "the `NOTICE` file", text)
    text = re.sub(r"The full documentation is in \[docs/\]\(docs/index\.md\)[^.]*\.",
                  "This site is built from the repository's `docs/` folder.", text, flags=re.S)
    return text
