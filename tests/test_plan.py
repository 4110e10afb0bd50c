"""`renderfarm plan`'s parts: the targets, the published architectures (shapes, no weights) and
the attention kernels a traced program took."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from diffusion.architectures import ARCHITECTURES, abstract_model
from diffusion.nn.attention import Call, attention, recording, use_kernel
from diffusion.targets import TARGETS, target, target_devices
from renderfarm.jobs import JobError


@pytest.mark.parametrize(("name", "says"), [
    ("v5e", ["target='v5e'", "must be one of", *TARGETS]),
    ("h100", ["target='h100'", "jax[cuda12]>=0.12", "Python 3.12"]),
])
def test_bad_targets_are_refused_by_name(name: str, says: list[str]) -> None:
    with pytest.raises(JobError) as err:
        target_devices(target(name))
    assert all(part in str(err.value) for part in says), err.value


def test_an_unknown_architecture_names_the_known_ones() -> None:
    with pytest.raises(JobError) as err:
        abstract_model("sd3")
    assert "model='sd3'" in str(err.value) and all(name in str(err.value) for name in ARCHITECTURES)


@pytest.mark.parametrize(("name", "family", "parameters"), [
    ("sd15", "sd", 1_066_235_307),  # diffusers' count of stable-diffusion-v1-5 (docs/performance.md)
    ("sdxl", "sdxl", 3_468_837_867),  # and of stable-diffusion-xl-base-1.0
])
def test_published_architectures_have_the_released_sizes(name: str, family: str, parameters: int) -> None:
    model = abstract_model(name, "bfloat16")
    leaves = jax.tree.leaves(model.params)
    assert model.family.name == family
    assert sum(leaf.size for leaf in leaves) == parameters
    assert {str(leaf.dtype) for leaf in leaves} == {"bfloat16"}


def test_recording_lists_the_kernel_each_attention_took() -> None:
    q = jax.ShapeDtypeStruct((1, 256, 4 * 8), jnp.float32)
    k = jax.ShapeDtypeStruct((1, 77, 4 * 8), jnp.float32)
    with recording() as calls:
        jax.jit(lambda q, k: attention(q, k, k, heads=4)).lower(q, k)
        with use_kernel("chunked"):
            jax.jit(lambda q: attention(q, q, q, heads=4, causal=True)).lower(q)
    assert calls == [Call("batch", 256, 77, 4, 8), Call("chunked", 256, 256, 4, 8)]
    jax.jit(lambda q: attention(q, q, q, heads=4)).lower(q)  # outside the block: not recorded
    assert len(calls) == 2
