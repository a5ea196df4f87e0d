"""Megatron <-> HF renaming as data: a rule table per model family (see families.py)."""
from trainer_svc.megatron.rules.base import Dims, Rule, RuleTable, Transform
from trainer_svc.megatron.rules.families import base_family, family_features, known_families, rules_for

__all__ = ["Dims", "Rule", "RuleTable", "Transform", "base_family", "family_features", "known_families", "rules_for"]
