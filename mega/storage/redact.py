"""Keep credentials out of logs and error messages.

botocore logs every request at DEBUG, Authorization header included (it carries the access key
id, and a session token travels in its own header). Turning DEBUG on to chase a storage problem
must not put credentials into a run's logs, which end up in artifacts. A log-record factory
(chained to whatever was installed before) scrubs records of the AWS client libraries and of
this package; ``redact`` does the same for exception text.
"""

from __future__ import annotations

import logging
import re
import threading

_lock = threading.Lock()
_secrets: set[str] = set()
_installed = False
_SOURCES = ("botocore", "boto3", "s3transfer", "urllib3", "mega.storage")
_PATTERNS = [
    re.compile(r"(Credential=)[^/\s,'\"]+"),  # SigV4 header and presigned-query forms
    re.compile(r"(Signature=)[0-9a-fA-F]+"),
    re.compile(r"(X-Amz-Security-Token['\"]?\s*[:=]\s*b?['\"]?)[^'\"\s,&]+", re.I),
]
MASK = "***"


def register(*secrets: str | None) -> None:
    """Strings (access key id, secret key, session token) never to show."""
    with _lock:
        # Too-short strings would mask innocent text; real AWS key material is far longer.
        _secrets.update(s for s in secrets if s and len(s) >= 8)
    _install()


def redact(text: str) -> str:
    for p in _PATTERNS:
        text = p.sub(lambda m: m.group(1) + MASK, text)
    for s in sorted(_secrets, key=len, reverse=True):
        if s in text:
            text = text.replace(s, MASK)
    return text


def _install() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        previous = logging.getLogRecordFactory()

        def factory(*args, **kwargs):
            record = previous(*args, **kwargs)
            if record.name.startswith(_SOURCES):
                try:
                    message = record.getMessage()
                except Exception:  # a broken format string is the logging module's to report
                    return record
                clean = redact(message)
                if clean != message:
                    record.msg, record.args = clean, None
            return record

        logging.setLogRecordFactory(factory)
        _installed = True
