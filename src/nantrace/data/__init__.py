"""nantrace's data layer: find the numerical failures that arrive with the data.

* `validate_batch` / `ValidatingCollate`: NaN/Inf inputs, labels outside
  ``[0, num_classes)`` or all ``ignore_index``, shape/dtype drift between batches,
  degenerate normalisation and distribution shifts, with the path inside the batch and
  the sample indices; the collate drops bad samples (``policy="skip"``) or raises.
* `compare_tokenizers`: training vs inference tokenizer, field by field.
* `validate_attention_mask`: padding, causality, packing isolation, fully masked rows.
* `audit_sampler`: disjoint, covering, even per-rank shards.
* `derive_seed`, `SeedChain`, `audit_augmentation`: reproducible per-stage randomness.
* `check_gradients`: gradcheck for custom autograd Functions with a precise message.

Usage::

    from torch.utils.data import DataLoader
    from nantrace.data import ValidatingCollate, validate_batch

    collate = ValidatingCollate(num_classes=10, policy="skip")
    loader = DataLoader(dataset, batch_size=64, collate_fn=collate, num_workers=2)
    for batch in loader:
        ...  # bad samples were dropped
    print(collate.skipped_samples, [i.summary for i in collate.issues])

    report = validate_batch({"pixel_values": x, "labels": y}, num_classes=10)
    if not report.ok:
        print(report)  # cause, path (batch["pixel_values"]), sample indices, fix
"""

from .batch import DEFAULT_LABEL_KEYS, BatchReport, BatchSchema, validate_batch
from .collate import DEFAULT_ENFORCED, GUARD_CAUSES, ValidatingCollate
from .gradcheck import GradcheckReport, GradientMismatch, check_gradients
from .issues import BATCH_CAUSES, MASK_CAUSES, DataIssue, DataValidationError
from .masks import MaskReport, validate_attention_mask
from .sampler import SAMPLER_CAUSES, SamplerReport, audit_sampler
from .seeds import SEED_CAUSES, AugmentationReport, SeedChain, audit_augmentation, derive_seed
from .tokenizer import (
    DEFAULT_PROBE_TEXTS,
    TOKENIZER_FIELDS,
    TokenizerDifference,
    TokenizerReport,
    compare_tokenizers,
)

__all__ = [
    "AugmentationReport",
    "BATCH_CAUSES",
    "BatchReport",
    "BatchSchema",
    "DEFAULT_ENFORCED",
    "DEFAULT_LABEL_KEYS",
    "DEFAULT_PROBE_TEXTS",
    "DataIssue",
    "DataValidationError",
    "GUARD_CAUSES",
    "GradcheckReport",
    "GradientMismatch",
    "MASK_CAUSES",
    "MaskReport",
    "SAMPLER_CAUSES",
    "SEED_CAUSES",
    "SamplerReport",
    "SeedChain",
    "TOKENIZER_FIELDS",
    "TokenizerDifference",
    "TokenizerReport",
    "ValidatingCollate",
    "audit_augmentation",
    "audit_sampler",
    "check_gradients",
    "compare_tokenizers",
    "derive_seed",
    "validate_attention_mask",
    "validate_batch",
]
