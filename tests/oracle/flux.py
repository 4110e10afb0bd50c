"""Reference data for Flux.1 (diffusion/nn/flux.py, t5.py, the 16-channel VAE, the flow-matching
Euler scheduler): diffusers' / transformers' PyTorch code on tiny random networks.

`write(data)` rebuilds `data/flux/`:

    modules/<name>/         one network saved by its class's save_pretrained (float16 safetensors of
                            float16-exact weights, computed with in float32), so the tests load it through the farm's own loader
                            (diffusion.weights, the "flux" / "t5" / "vae" kinds): transformer_schnell
                            (no guidance embedding), transformer_dev (guidance embedding), t5, vae
    modules/io.npz          per network `<name>/in/...` and `<name>/out/...` (float32, CPU)
    scheduler.json          FlowMatchEulerDiscreteScheduler as FluxPipeline drives it: per case the
                            config, steps, image_seq_len (mu from calculate_shift when dynamic), the
                            timesteps and sigmas after set_timesteps, and the trajectory of
                            `prev = step(model_output, t, sample)` on a fixed sample and output.
    <variant>/model/        a whole FluxPipeline folder, schnell and dev (save_pretrained, float16
                            safetensors of float16-exact weights; CLIP tokenizer files as
                            tests/oracle/pipelines.py writes them; a tiny T5 Unigram tokenizer made
                            by transformers' T5Tokenizer and saved as it saves one)
    <variant>/<i>.png       the images FluxPipeline renders from that folder (loaded back, float32)
                            with `latents=` the contract's (1, 16, h/8, w/8) latents packed
    jobs.json               every job: its fields, model folder and image
    t5_ids.json             ids transformers' T5 tokenizer gives a few texts, per max length

Weights: the libraries' initialisers under fixed seeds, then every 1-d weight (norm scales) 1 +
N(0, 0.1^2) and every bias N(0, 0.05^2) so a parameter a loader dropped would show, all rounded to
float16. Deterministic: running it twice writes the same bytes.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import warnings
from typing import Any

import numpy as np
import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline, calculate_shift
from transformers import CLIPTextModel, T5Config, T5EncoderModel, T5Tokenizer

from tests.oracle import pipelines

TRANSFORMER = {"patch_size": 1, "in_channels": 64, "num_layers": 2, "num_single_layers": 2, "attention_head_dim": 16,
               "num_attention_heads": 2, "joint_attention_dim": 24, "pooled_projection_dim": 20,
               "axes_dims_rope": [4, 6, 6]}
# Few buckets and a short max distance, so that 24 tokens reach the logarithmic buckets.
T5 = {"vocab_size": 120, "d_model": 24, "d_kv": 8, "d_ff": 37, "num_layers": 2, "num_heads": 3,
      "relative_attention_num_buckets": 8, "relative_attention_max_distance": 16, "feed_forward_proj": "gated-gelu",
      "is_encoder_decoder": False, "use_cache": False, "tie_word_embeddings": False}
VAE = {"in_channels": 3, "out_channels": 3, "block_out_channels": [4, 8, 8, 8], "layers_per_block": 1,
       "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
       "latent_channels": 16, "norm_num_groups": 2, "sample_size": 64, "scaling_factor": 0.3611,
       "shift_factor": 0.1159, "use_quant_conv": False, "use_post_quant_conv": False}
# The real checkpoints' scheduler_config.json (black-forest-labs/FLUX.1-schnell and -dev).
SCHEDULERS = {
    "schnell": {"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.30.0.dev0",
                "base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 4096, "max_shift": 1.15,
                "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False},
    "dev": {"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.30.0.dev0",
            "base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 4096, "max_shift": 1.15,
            "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True},
}
# (config, steps, image_seq_len): 64x64 and 64x128 tiny images, and the real model's 1024x1024 (4096).
SCHEDULER_CASES = [("schnell", 4, 16), ("schnell", 1, 16), ("dev", 4, 16), ("dev", 3, 32), ("dev", 28, 4096),
                   ("dev", 50, 1024)]


def liven(model: torch.nn.Module) -> torch.nn.Module:
    """Norm scales 1 + N(0, 0.1^2), biases N(0, 0.05^2), then every weight rounded to float16."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(0.05 * torch.randn_like(param))
            elif param.ndim == 1:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            param.copy_(param.half().float())
    return model.eval()


def transformer(guidance_embeds: bool, seed: int) -> FluxTransformer2DModel:
    torch.manual_seed(seed)
    model = FluxTransformer2DModel(**TRANSFORMER, guidance_embeds=guidance_embeds)
    return liven(model)


def t5(seed: int) -> T5EncoderModel:
    torch.manual_seed(seed)
    model = T5EncoderModel(T5Config(**T5))
    with torch.no_grad():  # transformers draws the token table with std 1 already; the rest as initialised
        model.shared.weight.normal_(0, 1)
    return liven(model)


def vae(seed: int) -> AutoencoderKL:
    torch.manual_seed(seed)
    return liven(AutoencoderKL(**VAE))


def save_half(model: torch.nn.Module, folder: pathlib.Path) -> None:
    """save_pretrained in float16 (exact: `liven` rounded every weight), the model left float32."""
    model.half().save_pretrained(folder, safe_serialization=True)
    model.float()


def _ids(height: int, width: int) -> torch.Tensor:
    return FluxPipeline._prepare_latent_image_ids(1, height, width, "cpu", torch.float32)


def write_modules(root: pathlib.Path) -> None:
    arrays: dict[str, np.ndarray] = {}
    gen = torch.Generator().manual_seed(0)
    for name, guided, seed in (("transformer_schnell", False, 1), ("transformer_dev", True, 2)):
        model = transformer(guided, seed)
        save_half(model, root / name)
        inputs = {"latents": torch.randn(2, 12, 64, generator=gen), "timestep": torch.tensor([1.0, 0.4217]),
                  "context": torch.randn(2, 5, 24, generator=gen), "pooled": torch.randn(2, 20, generator=gen),
                  "guidance": torch.tensor([3.5, 1.0]), "img_ids": _ids(3, 4), "txt_ids": torch.zeros(5, 3)}
        with torch.no_grad():
            out = model(hidden_states=inputs["latents"], encoder_hidden_states=inputs["context"],
                        pooled_projections=inputs["pooled"], timestep=inputs["timestep"], img_ids=inputs["img_ids"],
                        txt_ids=inputs["txt_ids"], guidance=inputs["guidance"] if guided else None).sample
        arrays |= {f"{name}/in/{k}": v.numpy() for k, v in inputs.items()} | {f"{name}/out/sample": out.numpy()}
    model = t5(3)
    save_half(model, root / "t5")
    ids = torch.from_numpy(np.random.default_rng(3).integers(0, T5["vocab_size"], (2, 24)))
    with torch.no_grad():
        arrays |= {"t5/in/input_ids": ids.numpy(), "t5/out/last_hidden_state": model(ids).last_hidden_state.numpy()}
    model = vae(4)
    save_half(model, root / "vae")
    latents = torch.randn(2, 16, 4, 6, generator=gen)
    with torch.no_grad():
        arrays |= {"vae/in/latents": latents.numpy(), "vae/out/decoded": model.decode(latents).sample.numpy()}
    np.savez_compressed(root / "io.npz", **arrays)


def scheduler_cases() -> list[dict[str, Any]]:
    """Each case as FluxPipeline runs the scheduler: sigmas linspace(1, 1/steps), mu from the
    image's token count, then step() on a fixed sample and model output."""
    cases = []
    rng = np.random.default_rng(5)
    for config_name, steps, seq_len in SCHEDULER_CASES:
        config = SCHEDULERS[config_name]
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
        mu = calculate_shift(seq_len, config["base_image_seq_len"], config["max_image_seq_len"],
                             config["base_shift"], config["max_shift"])
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        sample = torch.from_numpy(rng.standard_normal((1, 3, 4), dtype=np.float32))
        output = torch.from_numpy(rng.standard_normal((1, 3, 4), dtype=np.float32))
        start, trajectory = sample.numpy().tolist(), []
        scheduler.set_begin_index(0)
        for t in scheduler.timesteps:
            sample = scheduler.step(output, t, sample, return_dict=False)[0]
            trajectory.append(sample.numpy().tolist())
        cases.append({"config": config_name, "scheduler_config": config, "steps": steps, "image_seq_len": seq_len,
                      "timesteps": scheduler.timesteps.tolist(), "sigmas": scheduler.sigmas.tolist(),
                      "sample": start, "model_output": output.numpy().tolist(), "trajectory": trajectory})
    return cases


# The T5 tokenizer's pieces (SentencePiece-style scores; whole words beat their letters).
T5_WORDS = ("a", "red", "fox", "in", "fresh", "snow", "light", "house", "on", "cliff", "at", "dusk", "oil", "paint",
            "ing", "bowl", "of", "ramen", "the", "café", "night", "city")
T5_PIECES = ([("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
             + [(chr(c), -9.0) for c in range(33, 127)] + [(c, -9.5) for c in "éüçñ"]
             + [(p + w, -4.0 - 0.05 * i) for i, w in enumerate(T5_WORDS) for p in ("▁", "")])
SEQUENCE = {"schnell": 256, "dev": 512}  # FluxPipeline's max_sequence_length (BFL's per model)
TEXTS = ["a red fox in fresh snow", "  A Lighthouse   on a CLIFF, at dusk!  ", "café ünïcode 日本 </s> <pad> x",
         "", "ramen " * 300]
JOBS = {
    "schnell": ({"prompt": "a red fox in fresh snow", "seed": 0}, {"prompt": "a lighthouse on a cliff at dusk", "seed": 1},
                {"prompt": "a bowl of ramen, oil painting", "seed": 2}),
    "dev": ({"prompt": "a red fox in fresh snow", "seed": 0}, {"prompt": "the city at night, café", "seed": 3},
            {"prompt": "a lighthouse on a cliff at dusk", "seed": 4}),
}
RECIPES = {"schnell": {"steps": 4, "guidance_scale": 0.0}, "dev": {"steps": 3, "guidance_scale": 3.5}}
SIZES = ((64, 64), (64, 128))  # (width, height): the last job of each variant renders at the second


def t5_tokenizer(folder: pathlib.Path) -> T5Tokenizer:
    """The tiny T5 tokenizer as transformers builds and saves one (tokenizer.json, tokenizer_config.json)."""
    T5Tokenizer(vocab=T5_PIECES, extra_ids=0, model_max_length=512).save_pretrained(folder)
    return T5Tokenizer.from_pretrained(folder)


def pipeline(variant: str, tokenizer: Any, tokenizer_2: T5Tokenizer) -> FluxPipeline:
    seed = 10 * (variant == "dev")
    torch.manual_seed(seed)
    clip = liven(CLIPTextModel(pipelines._text_config(tokenizer, TRANSFORMER["pooled_projection_dim"], 37,
                                                      "quick_gelu")))
    torch.manual_seed(seed + 1)
    encoder_2 = T5EncoderModel(T5Config(**{**T5, "vocab_size": len(tokenizer_2)}))
    with torch.no_grad():
        encoder_2.shared.weight.normal_(0, 1)
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler.from_config(SCHEDULERS[variant]), vae=vae(seed + 2),
                        text_encoder=clip, tokenizer=tokenizer, text_encoder_2=liven(encoder_2),
                        tokenizer_2=tokenizer_2, transformer=transformer(variant == "dev", seed + 3))


def jobs(variant: str) -> list[dict[str, Any]]:
    """The variant's jobs with its recipe and their sizes (the last one at the second size)."""
    last = len(JOBS[variant]) - 1
    return [{**job, **RECIPES[variant], "width": SIZES[i == last][0], "height": SIZES[i == last][1]}
            for i, job in enumerate(JOBS[variant])]


def render(pipe: FluxPipeline, variant: str, job: dict[str, Any]) -> np.ndarray:
    """One job through FluxPipeline, `latents=` the contract's latents packed: (height, width, 3) uint8."""
    latents = pipelines.contract_latents(job["seed"], 16, job["width"], job["height"], pipe.vae_scale_factor)
    packed = pipe._pack_latents(latents, 1, 16, *latents.shape[2:])
    with torch.no_grad():
        image = pipe(job["prompt"], num_inference_steps=job["steps"], guidance_scale=job["guidance_scale"],
                     height=job["height"], width=job["width"], latents=packed, max_sequence_length=SEQUENCE[variant],
                     output_type="np").images[0]
    return (image * 255).round().astype(np.uint8)


def load(folder: pathlib.Path) -> FluxPipeline:
    """A pipeline folder loaded back in float32, without progress bars."""
    pipe = FluxPipeline.from_pretrained(folder, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def write_pipelines(root: pathlib.Path) -> None:
    tokenizer_2 = t5_tokenizer(root / "t5_tokenizer")
    cases = [{"text": text, "max_length": length, "ids": tokenizer_2(text, padding="max_length", max_length=length,
                                                                      truncation=True).input_ids}
             for length in sorted(set(SEQUENCE.values())) for text in TEXTS]
    (root / "t5_ids.json").write_text(json.dumps(cases) + "\n", encoding="utf-8")
    records = []
    for variant in SEQUENCE:
        folder = root / variant / "model"
        pipe = pipeline(variant, pipelines._tokenizer("<|endoftext|>"), tokenizer_2)
        pipe.to(torch.float16).save_pretrained(folder, safe_serialization=True)  # exact: see `liven`
        pipelines._prefix_text_model(folder / "text_encoder")
        pipelines._write_tokenizer(folder / "tokenizer", "<|endoftext|>")
        shutil.rmtree(folder / "tokenizer_2")
        shutil.copytree(root / "t5_tokenizer", folder / "tokenizer_2")
        pipe = load(folder)
        for i, job in enumerate(jobs(variant)):
            pipelines._save_png(root / variant / f"{i}.png", render(pipe, variant, job))
            records.append({**job, "model": f"{variant}/model", "image": f"{variant}/{i}.png"})
    shutil.rmtree(root / "t5_tokenizer")
    (root / "jobs.json").write_text(json.dumps({"versions": pipelines.versions(), "jobs": records}, indent=1) + "\n",
                                    encoding="utf-8")


def write(data: pathlib.Path) -> None:
    """Rebuild data/flux (see the module docstring)."""
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    root = pathlib.Path(data) / "flux"
    shutil.rmtree(root, ignore_errors=True)
    (root / "modules").mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        write_modules(root / "modules")
        write_pipelines(root)
    (root / "scheduler.json").write_text(json.dumps(scheduler_cases(), indent=1) + "\n", encoding="utf-8")
