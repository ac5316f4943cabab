"""Reading and writing policy.json.

Example::

    from precision_audit import load_policy
    policy = load_policy("audit/policy.json")     # or the folder "audit/"
    save_policy(policy, "audit/policy-v2.json")   # atomic: never a half-written file
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from .. import strict_json
from ..errors import OutputError, PolicyError
from ..strict_json import NotStrictJSON
from .schema import Policy

POLICY_FILE = "policy.json"


def _not_strict(e: NotStrictJSON, source: str) -> PolicyError:
    if e.kind == "duplicate":
        return PolicyError(f"{source}: policy has the key {e.value!r} twice in one object",
                           hint="keep one of them; JSON readers disagree on which one wins")
    return PolicyError(f"{source}: policy contains {e.value}, which is not JSON", hint="write a finite number")


def parse_policy(text: str, source: str = "policy") -> Policy:
    """Parse and validate policy JSON text; errors name the line and column, or the field."""
    try:
        # finite_floats=False: a number beyond a float reads as inf, which Policy.from_dict refuses naming the field
        doc = strict_json.loads(text, finite_floats=False)
    except json.JSONDecodeError as e:
        raise PolicyError(f"{source} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}",
                          hint="fix the JSON syntax there, or regenerate the policy with precision-audit") from None
    except RecursionError:
        raise PolicyError(f"{source} is nested too deeply to be a policy") from None
    except ValueError as e:  # an integer literal of more than 4300 digits (sys.get_int_max_str_digits())
        raise PolicyError(f"{source} holds an integer literal too long to read",
                          found=str(e).split(":")[-1].split(";")[0].strip()[:80]) from None
    except NotStrictJSON as e:
        raise _not_strict(e, source) from None
    return Policy.from_dict(doc)


def load_policy(path: str | os.PathLike[str]) -> Policy:
    """Load and validate a policy.json (a folder holding one also works).

    A malformed file raises :class:`~precision_audit.errors.PolicyError` naming the line and column (bad
    JSON) or the field (bad content); a policy of an unknown version says which versions this code reads.

    Example::

        policy = load_policy("audit/policy.json")
        handle = precision_audit.apply_policy(model, policy)
    """
    p = Path(path)
    if p.is_dir():
        p = p / POLICY_FILE
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise PolicyError(f"no policy file at {p}", hint="pass the policy.json that precision-audit wrote") from None
    except OSError as e:
        raise PolicyError(f"cannot read the policy {p}", found=f"{type(e).__name__}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise PolicyError(f"{p} is not UTF-8 text", found=f"byte {e.start}: {raw[e.start:e.start + 1]!r}") from None
    return parse_policy(text, str(p))


def dumps_policy(policy: Policy) -> str:
    """The policy as the JSON text :func:`save_policy` writes (2-space indent, trailing newline)."""
    return json.dumps(policy.to_dict(), indent=2, allow_nan=False) + "\n"


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` atomically: a temporary file in the same folder, fsync, then ``os.replace``.

    Raises :class:`~precision_audit.errors.OutputError` when it cannot be written; the old file (if any) is
    then left untouched.
    """
    p = Path(path)
    try:
        if p.is_dir():
            raise IsADirectoryError(21, "is a folder", str(p))
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    except OSError as e:
        raise OutputError(f"cannot write {p}", found=f"{type(e).__name__}: {e.strerror or e}") from None
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; a policy or config is meant to be shared
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise OutputError(f"cannot write {p}", found=f"{type(e).__name__}: {e.strerror or e}") from None
        raise
    return p


def save_policy(policy: Policy, path: str | os.PathLike[str]) -> Path:
    """Write ``policy`` to ``path`` atomically (never a half-written file); returns the path.

    Raises :class:`~precision_audit.errors.OutputError` when it cannot be written.
    """
    return write_text_atomic(path, dumps_policy(policy))
