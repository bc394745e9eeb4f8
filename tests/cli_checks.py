"""Helpers for the commands' output and error tests (tests/ is on sys.path through its conftest.py)."""
import re

from ds4sci import cli

#: A line of ds4sci's log format (``ds4sci.cli.main``): time, logger name, level, message.
LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ds4sci\.[\w.]+ (INFO|WARNING) ")


def log_messages(output: str) -> list[str]:
    """The messages of ``output`` (a command's stdout and stderr), which must hold ds4sci's log lines only (and the
    indented lines of a multi-line message, such as the training start-up block): no one else's line."""
    lines = [line for line in output.splitlines() if line.strip()]
    strangers = [line for line in lines if not (LOG_LINE.match(line) or line.startswith("  "))]
    assert not strangers, "lines that are not ds4sci's:\n" + "\n".join(strangers)
    return [LOG_LINE.sub("", line) for line in lines if LOG_LINE.match(line)]


def refused(capsys, argv: list[str]) -> str:
    """Run ``ds4sci ARGV`` in this process; it must refuse with exit status 2 (argparse's own checks, which exit, or
    a one-line command error) and no traceback. Returns what it wrote to stderr."""
    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # argparse's own checks
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err
