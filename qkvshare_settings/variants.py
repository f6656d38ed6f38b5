"""Variant names the commands' settings need before torch is imported. The names themselves, and the resolver that
checks them, are `qkvshare.configuration_qkvshare` (`VARIANTS`, `resolve_variant`); the per-head-count default lists
are `qkvshare.analysis.common.default_variants`."""

# The rows of the paper's synthetic and vision tables (its Tables 4-6), in its order: the default of `synthetic` and
# the first rows of `vision`.
PAPER_TABLE_VARIANTS = ("QKV", "Q=K-V", "(Q=K-V)+", "Q-K=V", "Q=K=V", "(Q=K=V)+")
