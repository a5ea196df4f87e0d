"""Megatron <-> HF renaming as data: a rule table per model family (see families.py)."""

from trainer_svc.actor.megatron.rules.base import Dims, Rule, RuleTable, Site, Transform
from trainer_svc.actor.megatron.rules.families import base_family, family_features, known_families, rules_for
from trainer_svc.actor.megatron.rules.mtp import MTP_STYLES

__all__ = [
    "MTP_STYLES",
    "Dims",
    "Rule",
    "RuleTable",
    "Site",
    "Transform",
    "base_family",
    "family_features",
    "known_families",
    "rules_for",
]
