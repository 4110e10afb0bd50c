"""Render-farm worker: loads diffusion pipelines and renders jobs on JAX devices."""
