"""Verification rules: pure functions from (draft, target scores, rng) to a Verdict."""

from accelgen.verify.block import verify_block
from accelgen.verify.default import default_verifier, exact_rule_verifier, greedy_rule_verifier
from accelgen.verify.greedy import verify_greedy
from accelgen.verify.gumbel import verify_gumbel
from accelgen.verify.multi_candidate import verify_without_replacement
from accelgen.verify.sampling import verify_node_by_node, verify_speculative_sampling
from accelgen.verify.bild import verify_bild
from accelgen.verify.contrastive import check_contrastive_options, verify_contrastive
from accelgen.verify.specdec import check_specdec_options, verify_specdec
from accelgen.verify.spectr import verify_spectr
from accelgen.verify.typical import check_typical_options, verify_typical

__all__ = ["default_verifier", "exact_rule_verifier", "greedy_rule_verifier", "verify_block", "verify_greedy", "verify_speculative_sampling", "verify_without_replacement"]
__all__ += ["check_contrastive_options", "check_specdec_options", "verify_bild", "verify_contrastive", "verify_specdec", "verify_spectr"]
__all__ += ["check_typical_options", "verify_typical", "verify_gumbel", "verify_node_by_node"]
