"""A suffix cache across requests (`SuffixCache`, one per model) and the drafter that
proposes from it (`SuffixCacheDrafter`, method `suffix` and an `auto` component)."""

from longspec.speculation.drafters.suffix_cache.drafter import SuffixCacheDrafter
from longspec.speculation.drafters.suffix_cache.index import SuffixCache

__all__ = ["SuffixCache", "SuffixCacheDrafter"]
