"""Secrets out of everything gpudiag records: one rule for names, one for URLs.

Evidence keeps an allow-list of environment variables, but allowed names can still carry
secrets (``NVIDIA_API_KEY``, ``SLURM_JOB_GPUS_TOKEN``) and allowed values can embed
credentials (``JAX_COMPILATION_CACHE_DIR=gs://user:PW@bucket``,
``XLA_FLAGS=--xla_dump_to=s3://AKIA:KEY@bucket``), which then also show up in a probe's
stderr, and ``GPUDIAG_DAEMON_URL=http://admin:PW@host`` lands in the daemon evidence.

- A variable whose name contains KEY, TOKEN, SECRET, PASSWORD, PASSWD, CREDENTIAL or AUTH
  keeps its name; its value becomes ``***``.
- The userinfo of anything URL-shaped (``scheme://user:pw@`` and ``//user:pw@``) becomes
  ``***`` in every text: values, stderr tails, messages, the daemon's URL.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# typing.TYPE_CHECKING without importing typing (the daemon-answered CLI call never needs it).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

REDACTED = "***"
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.IGNORECASE)
# scheme://userinfo@ or //userinfo@ ; userinfo stops at the first '/', '@' or blank.
_URL_USERINFO = re.compile(r"(?P<lead>(?:[A-Za-z][A-Za-z0-9+.-]*:)?//)(?P<info>[^/@\s]+)@")


def redact_text(text: str) -> str:
    """``s3://AKIA:KEY@bucket/x`` -> ``s3://***@bucket/x`` (anywhere in ``text``)."""
    if "@" not in text:
        return text
    return _URL_USERINFO.sub(lambda m: f"{m.group('lead')}{REDACTED}@", text)


def redact_environment(env: Mapping[str, str]) -> dict[str, str]:
    """Values of secret-looking names replaced; URL credentials cut from every other value."""
    return {k: REDACTED if SECRET_NAME.search(k) else redact_text(v) for k, v in env.items()}


def redact_record(value: Any) -> Any:
    """A JSON-able value with every string URL-redacted and every ``environment`` mapping
    name-redacted: what gpudiag writes or answers, at its one edge."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, Mapping):
        out: dict[Any, Any] = {}
        for k, v in value.items():
            if k == "environment" and isinstance(v, Mapping):
                out[k] = {name: REDACTED if isinstance(name, str) and SECRET_NAME.search(name)
                          else redact_record(val) for name, val in v.items()}
            else:
                out[k] = redact_record(v)
        return out
    if isinstance(value, (list, tuple)):
        return [redact_record(v) for v in value]
    return value
