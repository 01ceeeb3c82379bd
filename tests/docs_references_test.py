"""Every document the repository mentions is in the repository (no pointer to a file elsewhere)."""

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
# A path ending in .md that is not part of a URL (a URL's path follows "//" or a host name).
_MENTION = re.compile(r"(?<![\w/.:-])((?:\.\./|\./)?(?:[\w.-]+/)*[\w-]+\.md)\b")
_TEXT = (".py", ".md", ".toml", ".txt", ".yaml", ".yml", ".cfg")


def _tracked_text_files() -> list[pathlib.Path]:
    listed = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [ROOT / p for p in listed if p.endswith(_TEXT) or p in ("Dockerfile", ".ci/run")]


def _exists(mention: str, mentioned_in: pathlib.Path) -> bool:
    for base in (ROOT, mentioned_in.parent):
        path = (base / mention).resolve()
        if path.is_file() and path.is_relative_to(ROOT):
            return True
    # A bare name ("numerics.md" in docs/) may name a file in the same folder or docs/.
    return "/" not in mention and (ROOT / "docs" / mention).is_file()


def test_mentioned_documents_are_in_the_repository():
    missing = []
    for path in _tracked_text_files():
        for line_number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for mention in _MENTION.findall(line):
                if not _exists(mention, path):
                    missing.append(f"{path.relative_to(ROOT)}:{line_number}: {mention}")
    assert not missing, "documents mentioned but not in the repository:\n" + "\n".join(missing)


def test_the_scan_sees_a_missing_document(tmp_path):
    # The finder must catch the kind of pointer this test exists for, and skip URLs.
    outside = "../shared/ARCHITECTURE" + ".md"  # spelled apart so this file does not mention it
    line = f"see {outside} and https://example.org/docs/spec" + ".md"
    assert _MENTION.findall(line) == [outside]
    assert not _exists(outside, ROOT / "README.md")
    assert _exists("docs/architecture.md", ROOT / "README.md")
