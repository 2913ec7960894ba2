"""Each diagnosis names the mistake the check observed, not another (issue 31): every known
mistake, written as a mutated solution, gets the message about itself; and a wrong answer
points at the learner's definition, never at ``line 1, in <module>``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.grading import format_report, run_checks

ROOT = Path(__file__).resolve().parent.parent


def _messages(name, impl=None, root=None) -> dict[str, str]:
    return {r.name: r.message for r in run_checks(name, impl=impl, root=root).results
            if not r.passed}


# -- ch09.online_softmax ----------------------------------------------------------------------

def _overflows(out_1, lse_1, out_2, lse_2):  # right algebra, but forms exp(lse)
    total = torch.exp(lse_1) + torch.exp(lse_2)
    out = out_1 * torch.exp(lse_1).unsqueeze(-1) + out_2 * torch.exp(lse_2).unsqueeze(-1)
    return out / total.unsqueeze(-1), torch.log(total)


def _running_output_not_rescaled(out_1, lse_1, out_2, lse_2):  # the missing rescale
    lse = torch.logaddexp(lse_1, lse_2)
    return out_1 + out_2 * torch.exp(lse_2 - lse).unsqueeze(-1), lse


def _max_for_lse(out_1, lse_1, out_2, lse_2):  # right output, the lse a max
    lse = torch.logaddexp(lse_1, lse_2)
    out = (out_1 * torch.exp(lse_1 - lse).unsqueeze(-1)
           + out_2 * torch.exp(lse_2 - lse).unsqueeze(-1))
    return out, torch.maximum(lse_1, lse_2)


def _subtracts_lse_first(out_1, lse_1, out_2, lse_2):  # logaddexp by hand: -inf + inf = NaN
    lse = lse_1 + torch.log1p(torch.exp(lse_2 - lse_1))
    out = (out_1 * torch.exp(lse_1 - lse).unsqueeze(-1)
           + out_2 * torch.exp(lse_2 - lse).unsqueeze(-1))
    return out, lse


OVERFLOW, RESCALE, LSE, NAN = "overflowed", "rescale", "lse is wrong", "gave NaN"
ONLINE_SOFTMAX_MISTAKES = [
    (_overflows, {"large_scores_stay_finite": OVERFLOW}),
    (_running_output_not_rescaled, {"two_blocks_give_full_attention": RESCALE,
                                    "large_scores_stay_finite": RESCALE}),
    (_max_for_lse, {"two_blocks_give_full_attention": LSE}),
    (_subtracts_lse_first, {"starts_from_no_keys": NAN, "large_scores_stay_finite": NAN}),
]


@pytest.mark.parametrize("impl, named", ONLINE_SOFTMAX_MISTAKES)
def test_each_online_softmax_mistake_gets_its_own_diagnosis(impl, named):
    messages = _messages("ch09.online_softmax", impl)
    assert set(messages) == set(named)
    for check, mistake in named.items():
        assert mistake in messages[check]
        others = {OVERFLOW, RESCALE, LSE, NAN} - {mistake}
        assert not any(other in messages[check] for other in others), messages[check]
        if mistake != OVERFLOW:
            assert "never form exp(lse)" not in messages[check]


# -- ch10.balancing_loss ----------------------------------------------------------------------

def _loss(f_of, p_of=lambda probs: probs.mean(0), times_e=True):
    def load_balancing_loss(probs, expert, alpha=0.01):
        experts = probs.shape[-1]
        f = f_of(torch.bincount(expert.reshape(-1), minlength=experts).to(probs.dtype),
                 probs, expert)
        return alpha * (experts if times_e else 1) * (f * p_of(probs)).sum()
    return load_balancing_loss


_DIVIDES_BY_T = _loss(lambda counts, probs, expert: counts / probs.shape[0])
_F_WITH_A_GRADIENT = _loss(lambda counts, probs, expert: counts / expert.numel()
                           * (probs / probs.detach()).mean(0))  # same value, f differentiable
_NO_E = _loss(lambda counts, probs, expert: counts / expert.numel(), times_e=False)
_P_DETACHED = _loss(lambda counts, probs, expert: counts / expert.numel(),
                    p_of=lambda probs: probs.detach().mean(0))

BY_T, F_GRAD, FACTOR_E, NO_GRAD = "divides by T = ", "something besides P_i", \
    "factor E (the number of experts) is missing", "the loss has no gradient"
SAME_FACTOR = "the value is off by that factor too"
BALANCING_MISTAKES = [
    (_DIVIDES_BY_T, {"value": BY_T, "gradient_only_through_p": SAME_FACTOR}),
    (_F_WITH_A_GRADIENT, {"gradient_only_through_p": F_GRAD}),
    (_NO_E, {"value": FACTOR_E, "gradient_only_through_p": SAME_FACTOR}),
    (_P_DETACHED, {"gradient_only_through_p": NO_GRAD}),
]


@pytest.mark.parametrize("impl, named", BALANCING_MISTAKES)
def test_each_balancing_loss_mistake_gets_its_own_diagnosis(impl, named):
    messages = _messages("ch10.balancing_loss", impl)
    assert set(messages) == set(named)
    for check, mistake in named.items():
        assert mistake in messages[check]
        others = {BY_T, F_GRAD, FACTOR_E, NO_GRAD, SAME_FACTOR} - {mistake}
        assert not any(other in messages[check] for other in others), messages[check]
        assert "f_i is a count, with no gradient" not in messages[check]


# -- where a wrong answer was written -----------------------------------------------------------

def test_a_wrong_dispatch_points_at_the_learners_definition_not_line_1(tmp_path):
    source = (ROOT / "solutions" / "ch10_dispatch.py").read_text()
    wrong = source.replace("return arrived[regroup], incoming", "return arrived, incoming")
    assert wrong != source
    (tmp_path / "exercises").mkdir()
    path = tmp_path / "exercises" / "ch10_dispatch.py"
    path.write_text(wrong)
    report = run_checks("ch10.dispatch", root=tmp_path)
    failed = [r for r in report.results if not r.passed]
    assert failed and all(r.kind == "wrong" for r in failed)
    def_line = wrong.splitlines().index(
        next(line for line in wrong.splitlines() if line.startswith("def dispatch"))) + 1
    first = failed[0]
    assert "dispatch gave its experts the wrong rows" in first.message
    assert [(f.file, f.line, f.function) for f in first.frames] == [
        (str(path), def_line, "dispatch")]
    text = format_report(report, color=False)
    assert "line 1, in <module>" not in text
    assert f"{path}, line {def_line}, in dispatch" in text
