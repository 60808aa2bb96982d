"""Running the command line in-process as a user meets it: no traceback, one-line errors."""

from __future__ import annotations

from dvidshards.cli import main


def run(argv, capsys):
    """``dvidshards ARGV`` in this process: (exit code, stdout, stderr); a traceback fails the test."""
    code = main(argv)
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out, out.err
    return code, out.out, out.err


def one_line(err: str) -> str:
    """The error text, asserted to be one non-empty line."""
    text = err.strip()
    assert text and "\n" not in text, repr(err)
    return text
