"""The storage layout: where a campaign's files live under a storage root, in one place that
producers, workers, exports and galleries all use (docs/design.md lists every file)::

    ROOT/CAMPAIGN/JOB_ID.png        the image
    ROOT/CAMPAIGN/JOB_ID.json       its sidecar
    ROOT/CAMPAIGN/manifest.jsonl    one line per finished job (local folders; renderfarm.manifest)
    ROOT/CAMPAIGN/manifest/*.jsonl  the same as one part per stored submission (GCS)
    ROOT/CAMPAIGN/thumbs/JOB_ID.jpg thumbnail (~128 px) for the gallery
    ROOT/CAMPAIGN/index.html        static gallery page (relative links)
    ROOT/CAMPAIGN/preview.png       contact sheet of the newest thumbnails
    ROOT/~workers/HOST.json         a worker's start-up proof that it can write here

Names are relative to the root (a renderfarm.storage backend). Campaign names and job ids
are checked, so a name never reaches outside its campaign's folder.
"""

from __future__ import annotations

import re

from renderfarm.jobs import SHA256_RE, check_campaign

JOB_ID_RULE = "lowercase hex [0-9a-f]{1,128}"
_JOB_ID_RE = re.compile(r"[0-9a-f]{1,128}")
MANIFEST_BASENAME = "manifest.jsonl"


def validate_job_id(job_id: str) -> str:
    """Return ``job_id`` if it is lowercase hex, else raise ValueError (keeps names path-safe)."""
    if not isinstance(job_id, str) or not _JOB_ID_RE.fullmatch(job_id):
        raise ValueError(f"invalid job_id {job_id!r}: must be {JOB_ID_RULE}")
    return job_id


def image_name(campaign: str, job_id: str) -> str:
    """Relative name of a job's PNG image: ``CAMPAIGN/JOB_ID.png``."""
    return f"{check_campaign(campaign)}/{validate_job_id(job_id)}.png"


def sidecar_name(campaign: str, job_id: str) -> str:
    """Relative name of a job's sidecar JSON: ``CAMPAIGN/JOB_ID.json``."""
    return f"{check_campaign(campaign)}/{validate_job_id(job_id)}.json"


def manifest_name(campaign: str) -> str:
    """Relative name of a campaign's manifest (one JSON line per finished job)."""
    return f"{check_campaign(campaign)}/{MANIFEST_BASENAME}"


def thumbnail_name(campaign: str, job_id: str) -> str:
    """Relative name of a job's gallery thumbnail: ``CAMPAIGN/thumbs/JOB_ID.jpg``."""
    return f"{check_campaign(campaign)}/thumbs/{validate_job_id(job_id)}.jpg"


def source_thumbnail_name(campaign: str, sha256: str) -> str:
    """Relative name of an image job's source image thumbnail, one per source whatever the
    jobs it starts: ``CAMPAIGN/thumbs/source-SHA256.jpg``."""
    if not (isinstance(sha256, str) and SHA256_RE.fullmatch(sha256)):
        raise ValueError(f"init_image_sha256={sha256!r}: must be 64 lowercase hex digits")
    return f"{check_campaign(campaign)}/thumbs/source-{sha256}.jpg"


def index_name(campaign: str) -> str:
    """Relative name of a campaign's static gallery page: ``CAMPAIGN/index.html``."""
    return f"{check_campaign(campaign)}/index.html"


def preview_name(campaign: str) -> str:
    """Relative name of a campaign's contact sheet: ``CAMPAIGN/preview.png``."""
    return f"{check_campaign(campaign)}/preview.png"


def write_check_name(host: str) -> str:
    """Where a worker proves at start-up that it can write its output and read it back:
    ``~workers/HOST.json``, one a host, overwritten at each start (`~` is in no campaign's
    name, so no campaign's files are touched)."""
    return f"~workers/{re.sub(r'[^A-Za-z0-9._-]', '-', host)[:128] or 'host'}.json"


def sidecar_job_id(campaign: str, name: str) -> str | None:
    """The job id of `name` if it is a sidecar of the campaign (`sidecar_name`'s inverse)."""
    prefix, suffix = f"{check_campaign(campaign)}/", ".json"
    if name.startswith(prefix) and name.endswith(suffix) and _JOB_ID_RE.fullmatch(name[len(prefix):-len(suffix)]):
        return name[len(prefix):-len(suffix)]
    return None
