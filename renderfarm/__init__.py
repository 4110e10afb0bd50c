"""Render farm: distributed rendering jobs, workers and storage."""
