"""Paths users give on the command line: text files (`--prompt-file`, `--json-schema`,
`--grammar`: a file, or standard input for `-`, as UTF-8 text) and output directories,
with messages that point at the fix."""

from __future__ import annotations

import sys
from pathlib import Path

STDIN = Path("-")


def read_prompt_file(path: Path, flag: str = "--prompt-file", what: str = "prompt") -> str:
    """The UTF-8 text of `path` (`-`: standard input) given with `flag`; `what` names
    the file's role in the messages."""
    if path == STDIN:
        data, name = sys.stdin.buffer.read(), "standard input"
    else:
        if path.is_dir():
            raise IsADirectoryError(f"{flag} {path} is a directory; give a text file (or - for standard input)")
        if not path.is_file():
            raise FileNotFoundError(f"{what} file not found: {path}")
        data, name = path.read_bytes(), str(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{name} is not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start}); convert it first, "
            f"e.g. iconv -f latin1 -t utf-8 FILE > FILE.utf8"
        ) from None
    if not text:
        raise ValueError(f"the {what} is empty ({name} has no text)")
    return text


def check_output_directory(path: Path, flag: str = "--out") -> None:
    """An output directory may exist, but not as a file."""
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{flag} {path} is a file; give a directory")
