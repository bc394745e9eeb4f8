"""A helper for the commands' error tests (tests/ is on sys.path through its conftest.py)."""
from ds4sci import cli


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
