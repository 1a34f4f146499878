"""TTM embedding lookups: the op lives in :mod:`comera_engine.ops.ttm_lookup`."""

from ..ops.ttm_lookup import merge_tables, split_point, ttm_lookup, ttm_lookup_naive

__all__ = ["merge_tables", "split_point", "ttm_lookup", "ttm_lookup_naive"]
