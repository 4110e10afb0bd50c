"""Published scoring architectures the tests and the benchmarks both build at full size, as
shapes (no weights are downloaded)."""

from __future__ import annotations

# openai/clip-vit-large-patch14's config.json, the fields that shape the parameters: the CLIP
# score's and the aesthetic predictor's model, and the safety checker's tower.
VIT_L14 = {
    "model_type": "clip", "projection_dim": 768,
    "text_config": {"hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12,
                    "num_hidden_layers": 12, "vocab_size": 49408, "max_position_embeddings": 77,
                    "eos_token_id": 2, "model_type": "clip_text_model"},
    "vision_config": {"hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16,
                      "num_hidden_layers": 24, "patch_size": 14, "image_size": 224, "model_type": "clip_vision_model"},
}
