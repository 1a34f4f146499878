"""Helpers shared by the dashboard pages: store access, presets, previews, plots."""
