"""Producer side: ingest prompts, build and submit jobs. Needs no JAX."""

from producer.status import campaign_status, cancel_campaign
from producer.submit import Submission, WaitTimeout, submit, wait_for

__all__ = ["Submission", "WaitTimeout", "campaign_status", "cancel_campaign", "submit", "wait_for"]
