"""Sharded checkpoints that are complete or absent, automatic resume, resharding, export."""
