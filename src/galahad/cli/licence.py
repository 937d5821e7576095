"""`galahad-licence`: make an issuer key pair, issue licences, show (and check) a licence file.

    galahad-licence keygen --out DIR
    galahad-licence issue --issuer-key DIR/issuer.key --licensee NAME --points N --days D --out FILE
    galahad-licence show FILE [--issuer-key-pub PATH] [--ranks N]

Errors are one line on standard error and a non-zero exit status: 1 for a refusal or a failure,
2 for a malformed command line; 141, and nothing said, when the output is cut short (`| head`);
130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from collections.abc import Sequence

from galahad.config import issuer_key_of
from galahad.adapters.licence.document import LICENCE_FORMAT, LicenceTerms, licensee_problem
from galahad.adapters.licence.ed25519 import EdLicence, read_terms
from galahad.adapters.licence.issuer import generate_issuer, issue_licence, load_issuer_key, write_new_file
from galahad.cli.output import print_any_name, stdout_closed
from galahad.domain.error import GalahadError

__all__ = ["main"]

PROG = "galahad-licence"
ISSUER_KEY_VARIABLE = "GALAHAD_LICENCE_ISSUER_KEY"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    print_any_name()
    try:
        code = int(args.run(args))
        sys.stdout.flush()  # a reader gone early is found here, not in Python's flush at exit
        return code
    except BrokenPipeError:
        return stdout_closed()
    except (GalahadError, OSError, ValueError) as exc:
        print(f"{PROG}: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # the process boundary: one line, never a traceback
        print(f"{PROG}: internal error: {type(exc).__name__}: {_one_line(exc)}", file=sys.stderr)
        return 1


def _keygen(args: argparse.Namespace) -> int:
    private_path, public_path, fingerprint = generate_issuer(args.out)
    print(f"issuer private key: {private_path} (mode 0600; keep it offline, never on a server)")
    print(f"issuer public key:  {public_path} (give it to servers: {ISSUER_KEY_VARIABLE})")
    print(f"issuer fingerprint: {fingerprint}")
    return 0


def _issue(args: argparse.Namespace) -> int:
    issued = args.issued or dt.datetime.now(dt.timezone.utc).date()
    licence = issue_licence(load_issuer_key(args.issuer_key), args.licensee, args.points, issued, args.days)
    write_new_file(args.out, licence.encode(), 0o644)
    terms = LicenceTerms.from_payload(licence.payload)
    today = dt.datetime.now(dt.timezone.utc).date()
    if terms.expires <= today:  # a back-dated issue date: signed as asked, but no server takes it
        print(f"{PROG}: note: this licence expired on {terms.expires} (--issued {terms.issued} and --days "
              f"{args.days}); servers refuse it as expired", file=sys.stderr)
    print(f"licence {args.out}: {terms.licensee}, {_count(terms.points, 'point')}, issued {terms.issued}, "
          f"expires {terms.expires} (00:00 UTC), issuer {terms.issuer}")
    return 0


def _show(args: argparse.Namespace) -> int:
    _, terms = read_terms(args.file)
    print(f"file:     {args.file}")
    print(f"format:   {LICENCE_FORMAT}")
    print(f"licensee: {terms.licensee}")
    print(f"points:   {terms.points} (GPU ranks: tensor x pipeline x data parallel)")
    print(f"issued:   {terms.issued}")
    print(f"expires:  {terms.expires} (00:00 UTC)")
    print(f"issuer:   {terms.issuer}")
    issuer_keys = args.issuer_key_pub or issuer_key_of()  # the servers' setting, read by their rules
    if issuer_keys is None:
        print(f"validity: not checked (pass --issuer-key-pub or set {ISSUER_KEY_VARIABLE})")
        return 0
    status = EdLicence(args.file, issuer_keys).check(args.ranks)
    print(f"validity: {status.describe()} [checked against {issuer_keys}, {_count(args.ranks, 'rank')}]")
    return 0 if status.valid else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Galahad licences: issuer keys, issuing, checking.")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    keygen = commands.add_parser("keygen", help="make an issuer key pair (DIR/issuer.key, DIR/issuer.pub)")
    keygen.add_argument("--out", required=True, type=_path, metavar="DIR", help="folder for the pair (made 0700 if absent)")
    keygen.set_defaults(run=_keygen)
    issue = commands.add_parser("issue", help="sign a licence with an issuer's private key")
    issue.add_argument("--issuer-key", required=True, type=_path, metavar="PATH", help="the issuer.key made by keygen")
    issue.add_argument("--licensee", required=True, type=_licensee, help="who the licence is for")
    issue.add_argument("--points", required=True, type=_positive, help="GPU ranks covered (tensor x pipeline x data parallel)")
    issue.add_argument("--days", required=True, type=_days, help="days of validity from the issue date")
    issue.add_argument("--issued", type=_date, help="issue date YYYY-MM-DD (default: today, UTC)")
    issue.add_argument("--out", required=True, type=_path, metavar="FILE", help="the licence file to write (never replaced)")
    issue.set_defaults(run=_issue)
    show = commands.add_parser("show", help="print a licence's fields, and its validity when a key is known")
    show.add_argument("file", type=_path, metavar="FILE")
    show.add_argument("--issuer-key-pub", metavar="PATH",
                      help=f"issuer public key file or folder (default: ${ISSUER_KEY_VARIABLE})")
    show.add_argument("--ranks", type=_positive, default=1, help="GPU ranks to check the points against (1)")
    show.set_defaults(run=_show)
    return parser


def _path(text: str) -> str:
    """A path as given; an empty one (a shell variable left unset) is refused, never read as the
    current folder (keygen would write the private key there)."""
    if not text:
        raise argparse.ArgumentTypeError("the path is empty (is a shell variable unset?); give a path")
    return text


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


# Unicode's bidirectional formatting characters (embeddings, overrides, isolates, marks)
_BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
_MAX_DAYS = 36_600  # a hundred years: beyond it a typo, and soon beyond the calendar


def _days(text: str) -> int:
    value = _positive(text)
    if value > _MAX_DAYS:
        raise argparse.ArgumentTypeError(f"{value} days is more than a hundred years ({_MAX_DAYS}); "
                                         "give the days of validity")
    return value


def _licensee(text: str) -> str:
    if not 0 < len(text.strip()) <= 200:
        raise argparse.ArgumentTypeError("a licensee is a name of 1 to 200 characters")
    if undecoded := next((c for c in text if "\udc80" <= c <= "\udcff"), ""):  # a byte the locale could not decode
        raise argparse.ArgumentTypeError(f"the licensee holds the byte {ord(undecoded) - 0xDC00:#04x}, which is not "
                                         "UTF-8 text (a terminal in another encoding?); give the name as UTF-8")
    if bidi := next((c for c in text if c in _BIDI_CONTROLS), ""):  # would reorder the log line it is shown in
        raise argparse.ArgumentTypeError(f"the licensee holds the bidirectional control character U+{ord(bidi):04X}, "
                                         "which reorders the text around it wherever the name is shown (the "
                                         "server's log line); give the name without it")
    if problem := licensee_problem(text.strip()):
        raise argparse.ArgumentTypeError(f"the licensee {problem}; give the name on one line, without "
                                         "control characters")
    return text.strip()


def _date(text: str) -> dt.date:
    try:
        return dt.date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a date (YYYY-MM-DD)") from None


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror and exc.filename:
        return f"{exc.filename}: {exc.strerror}"
    return " ".join(str(exc).split()) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
