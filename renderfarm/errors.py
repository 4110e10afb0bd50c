"""The error every rule of the farm's contracts raises: which field, which value, which rule.
It is the model layer's error (diffusion/errors.py) under the contract's name, so a job the
contract refuses and one its model refuses fail alike (a dead letter with that text). Its own
module, so that the contract (renderfarm/jobs.py) and what it reads (the score filters,
renderfarm/scores.py) both raise it without importing each other."""

from diffusion.errors import ModelError as JobError
from diffusion.errors import shown

__all__ = ["JobError", "shown"]
