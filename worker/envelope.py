"""The door every queue message passes before kombu or Celery touches it.

Anything at all may arrive on a queue: a broken producer, a hostile one, a message of another
app. kombu decodes the body when it builds a Message (a body that is not base64, or an
unknown `body_encoding`, raises inside the consumer), and Celery reads header fields as it
builds a Request (a task id that is a JSON list makes its bookkeeping raise). Either kills the
consumer, the message goes back to the head of the queue, and the next worker dies on it too.
So the transport (worker.broker) checks each raw item here first: what comes out is a kombu
payload that kombu and Celery can take without raising, and whose body is the job's
keyword fields; what does not gets its reason, and goes to the dead letters.

The farm's producer leaves the argument reprs out of its messages (they would double a
queued job's bytes: producer/submit.py); the door writes them into the headers, as Celery's
`send_task` would have, so Flower shows every job's fields.

The message and its body are decoded as kombu decodes them (kombu.utils.json.loads: the
decoder its serializer registry has for `application/json`, which Celery's `message.payload`
runs, and the one kombu's restore reads an unacked record with): its object hook turns
`{"__type__": ..., "__value__": ...}` objects into datetimes, UUIDs, bytes and the like, and
raises for an unknown type or a bad value. Decoded any other way, a message could pass here and
make kombu raise later: Celery would log it and acknowledge it, and the job would vanish with no
dead letter and no failure recorded.

The job's own fields are checked later, by the job contract (renderfarm.jobs.parse_job), where
a failure is recorded as the job's result too.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from celery.utils.saferepr import saferepr
from kombu.utils.json import loads as kombu_loads

from renderfarm.errors import shown
from renderfarm.queue import REPR_LIMIT, TASK_NAME

MAX_MESSAGE_BYTES = 1 << 20  # a job with two 10,000-character prompts is far below this
MAX_ID_CHARS = 256

# Text headers Celery reads as it builds a Request and sends its events; other headers are
# carried along unread.
TEXT_HEADERS = ("lang", "root_id", "parent_id", "group", "shadow", "origin", "argsrepr", "kwargsrepr")
MAX_HEADER_CHARS = 1 << 16
# Celery would schedule or expire these, and kombu decompress the body by the last (a small
# message may inflate a thousandfold); a render job does none of it.
UNSUPPORTED_HEADERS = {"eta": "render jobs are not scheduled", "expires": "render jobs are not scheduled",
                       "compression": "render jobs are sent uncompressed"}
UNSUPPORTED_EMBED = ("callbacks", "errbacks", "chain", "chord")


class Rejected(Exception):
    """Why a message cannot be delivered, in the job contract's words: field, value, rule."""

    def __init__(self, field: str, value: Any, rule: str) -> None:
        super().__init__(f"{field}={shown(value)}: {rule}")
        self.field = field


def open_envelope(item: bytes) -> dict[str, Any]:
    """Check one raw queue item; its kombu payload, which kombu and Celery can take without
    raising, or Rejected naming the first thing wrong with it."""
    if len(item) > MAX_MESSAGE_BYTES:
        raise Rejected("message", f"<{len(item)} bytes>", f"must be at most {MAX_MESSAGE_BYTES} bytes")
    payload = _json("message", item)
    _require(payload, dict, "message", "must be a JSON object")
    properties = payload.get("properties")
    _require(properties, dict, "properties", "must be a JSON object")
    _text(properties.get("delivery_tag"), "properties.delivery_tag")
    info = properties.get("delivery_info")
    _require(info, dict, "properties.delivery_info", "must be a JSON object")
    for key in ("exchange", "routing_key"):
        _require(info.get(key), str, f"properties.delivery_info.{key}", "must be a string")
    priority = properties.get("priority")
    if priority is not None and (type(priority) is not int or not 0 <= priority <= 255):
        raise Rejected("properties.priority", priority, "must be an integer in 0..255 or null")
    for key in ("correlation_id", "reply_to"):
        _require(properties.get(key), (str, type(None)), f"properties.{key}", "must be a string or null")
    encoding = properties.get("body_encoding")
    if encoding not in ("base64", None):
        raise Rejected("properties.body_encoding", encoding, "must be 'base64' or absent (a JSON text body)")
    if payload.get("content-type") != "application/json":
        raise Rejected("content-type", payload.get("content-type"), "must be 'application/json'")
    if payload.get("content-encoding") != "utf-8":
        raise Rejected("content-encoding", payload.get("content-encoding"), "must be 'utf-8'")
    headers = payload.get("headers")
    _check_headers(headers)
    args, kwargs = _check_body(payload.get("body"), encoding)
    if headers.get("argsrepr") is None:
        headers["argsrepr"] = _repr(tuple(args))
    if headers.get("kwargsrepr") is None:
        headers["kwargsrepr"] = _repr(kwargs)
    return payload


def _repr(value: Any) -> str:
    """What Flower shows of a job's arguments: Celery's saferepr (30x a repr) only to cut it."""
    text = repr(value)
    return text if len(text) <= REPR_LIMIT else saferepr(value, REPR_LIMIT)


def _check_headers(headers: Any) -> None:
    _require(headers, dict, "headers", "must be a JSON object")
    if headers.get("task") != TASK_NAME:
        raise Rejected("headers.task", headers.get("task"), f"must be {TASK_NAME!r}")
    _text(headers.get("id"), "headers.id")
    for key in TEXT_HEADERS:
        if headers.get(key) is not None:
            _text(headers[key], f"headers.{key}", MAX_HEADER_CHARS, empty=True)
    _require(headers.get("ignore_result"), (bool, type(None)), "headers.ignore_result", "must be true, false or null")
    for key, why in UNSUPPORTED_HEADERS.items():
        if headers.get(key) is not None:
            raise Rejected(f"headers.{key}", headers[key], f"must be null ({why})")
    retries = headers.get("retries", 0)
    if type(retries) is not int or not 0 <= retries <= 1000:
        raise Rejected("headers.retries", retries, "must be an integer in 0..1000")
    limits = headers.get("timelimit")
    if limits is not None and not (isinstance(limits, list) and len(limits) == 2 and all(
            limit is None or (type(limit) in (int, float) and 0 <= limit < 1e9) for limit in limits)):
        raise Rejected("headers.timelimit", limits, "must be null or [soft, hard] seconds or nulls")


def _check_body(body: Any, encoding: str | None) -> tuple[list, dict]:
    """The body's args and kwargs: JSON text, or base64 of it (`send_task`'s), taken to bytes
    as kombu's Message takes it (a text body encoded to UTF-8, where a lone surrogate would
    raise) and decoded as kombu decodes it."""
    if encoding is None:
        _require(body, str, "body", "must be JSON text (no body_encoding)")
        try:
            raw = body.encode("utf-8")
        except UnicodeEncodeError as err:
            raise Rejected("body", body, f"must be valid Unicode ({err.reason} at {err.start})") from None
    else:
        _require(body, str, "body", "must be a base64 string")
        try:
            raw = base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            raise Rejected("body", body, "must be base64") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise Rejected("body", raw, f"must be UTF-8 ({err.reason} at byte {err.start})") from None
    decoded = _json("body", text)
    if not (isinstance(decoded, list) and len(decoded) == 3):
        raise Rejected("body", decoded, "must be Celery's [args, kwargs, embed]")
    args, kwargs, embed = decoded
    _require(args, list, "body.args", "must be a JSON array")
    _require(kwargs, dict, "body.kwargs", "must be a JSON object")
    _require(embed, dict, "body.embed", "must be a JSON object")
    for key in UNSUPPORTED_EMBED:
        if embed.get(key) is not None:
            raise Rejected(f"body.embed.{key}", embed[key], "must be null (render jobs have no callbacks)")
    return args, kwargs


def _json(field: str, text: bytes | str) -> Any:
    """Decoded as kombu decodes it (see the module's docstring), or Rejected with whatever that
    raises: ValueError for bad syntax, bytes that are not UTF-8, integers over 4,300 digits and
    an unknown `__type__`; RecursionError for deep nesting; a type's own error for a bad value."""
    try:
        return kombu_loads(text)
    except Exception as err:  # noqa: BLE001 - anything kombu would raise on, refused here
        raise Rejected(field, text, f"must be JSON that kombu decodes ({type(err).__name__}: {str(err)[:80]})") \
            from None


def _require(value: Any, types: type | tuple[type, ...], field: str, rule: str) -> None:
    if not isinstance(value, types):
        raise Rejected(field, value, rule)


def _text(value: Any, field: str, limit: int = MAX_ID_CHARS, empty: bool = False) -> None:
    """A string Celery can hash, log and store (valid Unicode, bounded; ids not empty)."""
    if not isinstance(value, str) or not (value or empty) or len(value) > limit:
        rule = "a string" if empty else "a non-empty string"
        raise Rejected(field, value, f"must be {rule} of at most {limit} characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise Rejected(field, value, "must be valid Unicode") from None
