"""Multi-token prediction (DeepSeek-V3 sec. 2.2): the config, the loss against its closed form, training
through the CLI with an exact resume, and self-speculative decoding: equal to plain greedy decoding at temperature 0,
drawing from plain sampling's distribution otherwise."""

from __future__ import annotations

import collections
import json
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY_ARGS, corpus, fast_args, tiny_config, tokens
from torch.testing import assert_close

from lmlab import Transformer, cli, speculative
from lmlab.config import ModelConfig
from lmlab.generate import generate, left_pad
from lmlab.loss import IGNORE_INDEX
from lmlab.mtp import checkpoint_prefixes, shift_left
from lmlab.sampling import make_probabilities
from lmlab.speculative import SpeculationStats, Speculator, draft_reference, speculate


def mtp_model(depth: int = 1, **fields) -> Transformer:
    return Transformer(tiny_config(init_std=0.1, **{"mtp.depth": depth}, **fields)).eval()


# ============================================================== config and structure
@pytest.mark.parametrize("field, value, message", [
    ("mtp.depth", 0, "mtp.depth=0 is not valid; it must be > 0"),
    ("mtp.loss_weight", -0.1, "mtp.loss_weight=-0.1 is not valid; it must be >= 0"),
])
def test_bad_mtp_config_names_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**{field: value})


def test_mtp_leaves_the_main_model_as_it_was():
    """Same seed: the main weights and logits are those of the model without MTP; the loss adds the MTP term."""
    plain, mtp = Transformer(tiny_config()), Transformer(tiny_config(**{"mtp.depth": 2}))
    main = plain.state_dict()
    assert {k for k in mtp.state_dict() if not k.startswith("mtp.")} == set(main)
    for name, value in main.items():
        assert torch.equal(mtp.state_dict()[name], value), name
    idx = tokens(2, 13)
    a, b = plain(idx[:, :-1], idx[:, 1:]), mtp(idx[:, :-1], idx[:, 1:])
    assert torch.equal(a.logits, b.logits) and torch.equal(a.ce_loss, b.ce_loss)
    assert set(b.aux_losses) == {"mtp"} and torch.equal(b.loss, b.ce_loss + b.aux_losses["mtp"])
    assert "mtp" not in mtp(idx).aux_losses  # no targets: the modules do not run
    assert mtp.num_params()["total"] > plain.num_params()["total"]
    assert mtp.flops_per_token() > plain.flops_per_token()


def test_checkpoint_prefixes_follow_deepseek_v3():
    names = checkpoint_prefixes(n_layers=61, depth=1)
    assert names == {
        "mtp.layers.0.enorm": "model.layers.61.enorm", "mtp.layers.0.hnorm": "model.layers.61.hnorm",
        "mtp.layers.0.eh_proj": "model.layers.61.eh_proj", "mtp.layers.0.norm": "model.layers.61.shared_head.norm",
        "mtp.layers.0.block": "model.layers.61",
    }
    params = {n.rsplit(".", 1)[0] for n, _ in mtp_model(1).named_parameters() if n.startswith("mtp.")}
    assert all(any(p == k or p.startswith(k + ".") for k in names) for p in params), params


def test_shift_left():
    t = torch.tensor([[1, 2, 3, 4]])
    assert shift_left(t, 0).tolist() == [[1, 2, 3, 4]]
    assert shift_left(t, 1).tolist() == [[2, 3, 4, IGNORE_INDEX]]
    assert shift_left(t, 3, fill=0).tolist() == [[4, 0, 0, 0]]
    assert shift_left(t, 6).tolist() == [[IGNORE_INDEX] * 4]


# ============================================================== the loss
@pytest.mark.parametrize("depth", [1, 3])
def test_mtp_loss_is_its_closed_form(depth):
    """L_MTP = lambda / D * sum_k mean_i CE(head(norm_k(h^k_i)), t_{i+k+1}), over the positions whose target
    is in the window; module k at position i reads t_{i+k} (eq. 21-25)."""
    model = mtp_model(depth, **{"mtp.loss_weight": 0.25})
    x = tokens(2, 11, seed=3)  # t_0 .. t_10
    idx, targets = x[:, :-1], x[:, 1:]
    T = idx.shape[1]
    with torch.no_grad():
        out = model(idx, targets)
        h, ctx = model.hidden_and_context(idx)
        want = []
        for k, module in enumerate(model.mtp.layers, start=1):  # by hand, from the full sequence x
            emb = model.embed_tokens(torch.cat([x[:, k:], x.new_zeros(2, k - 1)], dim=1)[:, :T])  # t_{i+k}
            h = module(h, emb, ctx)
            logits = model.head(module.norm(h))  # (B, T, V)
            n = T - k  # positions i with t_{i+k+1} in x
            want.append(F.cross_entropy(logits[:, :n].flatten(0, 1), x[:, k + 1 :].flatten()))
    assert_close(out.aux_losses["mtp"], 0.25 * torch.stack(want).mean())


def test_a_prediction_that_reads_or_scores_an_ignored_token_is_left_out():
    """targets[i] = IGNORE_INDEX (t_{i+1} unknown): depth k leaves out every position whose inputs t_{i+1} ..
    t_{i+k} or whose target t_{i+k+1} is unknown."""
    model = mtp_model(2)
    x = tokens(1, 10, seed=4)
    targets = x[:, 1:].clone()
    targets[0, 3] = IGNORE_INDEX
    T = targets.shape[1]
    with torch.no_grad():
        got = model(x[:, :-1], targets).aux_losses["mtp"]
        h, ctx = model.hidden_and_context(x[:, :-1])
        want = []
        for k, hk in enumerate(model.mtp.hidden_states(h, targets, ctx, model.embed_tokens), start=1):
            keep = [i for i in range(T - k) if all(targets[0, j] != IGNORE_INDEX for j in range(i, i + k + 1))]
            want.append(F.cross_entropy(model.head(hk[0, keep]), targets[0, [i + k for i in keep]]))
    assert len(keep) == T - 2 - 3  # depth 2: positions 1, 2, 3 read or score t_4
    assert_close(got, 0.3 * torch.stack(want).mean())


# ============================================================== speculative decoding
def greedy(model, idx, mask, n, decoder, eos_id=None):
    return torch.stack(list(generate(model, idx, n, temperature=0, attention_mask=mask, decoder=decoder,
                                     eos_id=eos_id)))  # (steps, B)


PROMPTS = [[5, 9, 1, 33, 2], [7], [3, 3, 8, 60, 12, 40, 1, 9, 22]]


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_speculative_equals_greedy_and_drafts_equal_the_reference(depth, monkeypatch):
    """A padded batch, the MTP modules drafting: the same tokens as plain greedy decoding, and at every round
    the cached drafts equal the drafts recomputed from scratch."""
    model = mtp_model(depth, init_seed=depth)
    idx, mask = left_pad(PROMPTS)
    rounds = []
    draft = Speculator.draft

    def checked(self):
        draft(self)
        want = draft_reference(self.model, self.seq[:, : self.n], None if self.real is None else self.real[:, : self.n])
        assert torch.equal(self.seq[:, self.n : self.n + self.D], want)
        rounds.append(self.n)

    monkeypatch.setattr(Speculator, "draft", checked)
    assert torch.equal(greedy(model, idx, mask, 30, "speculative"), greedy(model, idx, mask, 30, "eager"))
    assert len(rounds) >= 10


def oracle_drafts(want: torch.Tensor, T: int, wrong: float, seed: int):
    """A stand-in for Speculator.draft: the true greedy tokens ``want`` (steps, B), each replaced by a wrong one
    with probability ``wrong``, so that acceptance lengths vary by row and round."""
    g = torch.Generator().manual_seed(seed)

    def draft(self):
        for k in range(self.D):
            step = self.n - T + k
            true = want[step] if step < want.shape[0] else torch.zeros_like(want[0])
            miss = torch.rand(true.shape, generator=g) < wrong
            self.seq[:, self.n + k] = torch.where(miss, (true + 1) % 64, true)

    return draft


@pytest.mark.parametrize("depth, wrong", [(1, 0.0), (2, 0.3), (4, 0.2), (3, 1.0)])
def test_speculative_commits_exactly_the_greedy_tokens_whatever_is_accepted(depth, wrong, monkeypatch):
    """Drafts that are right except where made wrong at random: acceptance varies per row and round, and the
    output is still plain greedy's, token for token (with EOS ids: finished rows repeat the first)."""
    model = mtp_model(depth)
    idx, mask = left_pad(PROMPTS)
    want = greedy(model, idx, mask, 40, "eager")
    eos = int(want[7, 1])  # a token some row produces: rows finish at different steps
    want_eos = greedy(model, idx, mask, 40, "eager", eos_id=eos)
    monkeypatch.setattr(Speculator, "draft", oracle_drafts(want, idx.shape[1], wrong, seed=depth))
    assert torch.equal(greedy(model, idx, mask, 40, "speculative"), want)
    stats = SpeculationStats()
    list(speculate(model, idx, mask, 40, stats=stats))
    if wrong in (0.0, 1.0):  # every draft accepted (D + 1 tokens a round), or none (1 a round)
        assert stats.acceptance_rate == 1 - wrong and stats.tokens_per_round == 1 + depth * (1 - wrong)
    else:  # the batch advances by its least-accepting row
        assert 0 < stats.acceptance_rate < 1 and 1 < stats.tokens_per_round < 1 + depth
    monkeypatch.setattr(Speculator, "draft", oracle_drafts(want, idx.shape[1], wrong, seed=depth))
    assert torch.equal(greedy(model, idx, mask, 40, "speculative", eos_id=eos), want_eos)


def test_speculative_refusals():
    idx = [[1, 2, 3]]
    with pytest.raises(ValueError, match=r"this model has none \(mtp=None\); train one with --model.mtp.depth 1"):
        generate(Transformer(tiny_config()), idx, 4, temperature=0, decoder="speculative")
    learned = mtp_model(2, positions="learned")  # max_seq_len 32: the verify forward reads 2 slots past the end
    with pytest.raises(ValueError, match="prompt \\+ max_new_tokens \\+ mtp.depth = 33 must fit max_seq_len=32"):
        generate(learned, idx, 28, temperature=0, decoder="speculative")
    assert greedy(learned, torch.tensor(idx), None, 27, "speculative").shape == (27, 1)


# ============================================================== through the command line
def test_cli_trains_resumes_exactly_evaluates_and_decodes_speculatively(capsys, tmp_path):
    """`lmlab train --model.mtp.depth 2`: the MTP loss is logged apart; stopping at step 2 and resuming gives
    the run that did not stop, record for record; eval reads the main model; speculative generation prints
    what greedy prints."""
    source = corpus(tmp_path / "corpus.txt")
    common = ["--data.source", str(source), *TINY_ARGS, *fast_args(), "--model.mtp.depth", "2",
              "--eval.every", "2", "--checkpoint.every", "2"]

    def train(run, steps, *extra):
        code = cli.main(["train", "--run-dir", str(tmp_path / run), *common, "--train.steps", str(steps), *extra])
        capsys.readouterr()
        assert code == 0
        return [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    straight = train("straight", 4)
    train("resumed", 2)
    code = cli.main(["train", "--run-dir", str(tmp_path / "resumed"), "--resume", "--train.steps", "4", "--quiet"])
    assert code == 0
    resumed = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    keys = ("loss", "aux_losses", "grad_norm", "val_loss")
    assert [{k: r.get(k) for k in keys} for r in resumed] == [{k: r.get(k) for k in keys} for r in straight]
    assert all(r["aux_losses"]["mtp"] > 0 for r in straight)  # reported apart from the cross-entropy

    capsys.readouterr()
    assert cli.main(["eval", str(tmp_path / "resumed"), "--json", "--checkpoint", "latest", "--batch-size", "4",
                     "--max-batches", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["step"] == 4 and report["loss"] == pytest.approx(straight[-1]["val_loss"], rel=1e-6)

    outs = []
    for decoder in ("eager", "speculative"):
        assert cli.main(["generate", str(tmp_path / "resumed"), "--prompt", "the model", "--max-new-tokens", "24",
                         "--temperature", "0", "--decoder", decoder]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and len(outs[0]) > len("the model") + 10
    sampled = []
    for _ in range(2):  # speculative sampling: reproducible with a seed
        assert cli.main(["generate", str(tmp_path / "resumed"), "--prompt", "the model", "--max-new-tokens", "24",
                         "--temperature", "0.8", "--top-k", "20", "--seed", "1", "--decoder", "speculative"]) == 0
        sampled.append(capsys.readouterr().out)
    assert sampled[0] == sampled[1] and len(sampled[0]) > len("the model") + 10


def test_mtp_is_named_in_the_config():
    assert ModelConfig().mtp is None
    cfg = ModelConfig().override({"mtp.depth": 2})
    assert cfg.mtp.depth == 2 and cfg.mtp.loss_weight == 0.3
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_an_moe_models_mtp_block_is_moe_and_its_losses_and_biases_count():
    """DeepSeek-V3's MTP layer is a mixture-of-experts layer like the main layers after the first dense ones: its
    balance loss joins the main layers', and loss-free balancing updates its router bias too."""
    cfg = ModelConfig.from_preset("deepseek-v3", d_model=32, n_layers=2, vocab_size=64, **{"mtp.depth": 1})
    model = Transformer(cfg)
    (mtp_moe,) = model.mtp.moe_layers
    x = tokens(2, 13, seed=7)
    out = model(x[:, :-1], x[:, 1:])
    main = sum(moe.aux_losses["expert_balance"] for moe in model.moe_layers)
    assert_close(out.aux_losses["expert_balance"], main + mtp_moe.aux_losses["expert_balance"])
    out.loss.backward()
    before = mtp_moe.router.score_bias.clone()
    model.update_router_biases()
    assert not torch.equal(mtp_moe.router.score_bias, before)
    counts = model.num_params()  # the MTP layer's idle experts are not active parameters either
    assert counts["total"] - counts["active"] == sum(m.inactive_params() for m in [*model.moe_layers, mtp_moe])


# ============================================================== speculative sampling
PROMPT = [1, 5, 9]
SAMPLING = dict(temperature=0.8, top_k=3, top_p=0.95)


def plain_sampling_distribution(model, steps: int) -> dict[tuple[int, ...], float]:
    """The exact probability of every sequence of the first ``steps`` tokens plain sampling draws after PROMPT."""
    probs = make_probabilities(vocab_size=model.config.vocab_size, **SAMPLING)
    out = {(): 1.0}
    for _ in range(steps):
        prefixes = list(out)
        with torch.no_grad():
            p = probs(model(torch.tensor([PROMPT + list(x) for x in prefixes])).logits[:, -1])  # (N, V)
        out = {x + (v,): out[x] * float(p[i, v]) for i, x in enumerate(prefixes) for v in p[i].nonzero()[:, 0].tolist()}
    return out


def chi_square(counts: collections.Counter, expected: dict[tuple[int, ...], float], n: int) -> tuple[float, float]:
    """(Pearson's statistic, its p-value) of ``counts`` against ``n`` draws from ``expected``, cells expecting
    fewer than 5 pooled into one; (inf, 0) if a sequence plain sampling never draws was drawn."""
    if not set(counts) <= set(expected):
        return math.inf, 0.0
    small = [x for x, p in expected.items() if p * n < 5]
    cells = [(counts[x], p * n) for x, p in expected.items() if p * n >= 5]
    cells.append((sum(counts[x] for x in small), sum(expected[x] for x in small) * n))
    stat = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    df = sum(1 for _, e in cells if e > 0) - 1
    return stat, float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


def speculative_counts(model, n: int, seed: int, steps: int) -> collections.Counter:
    idx = torch.tensor([PROMPT] * n)
    out = torch.stack(list(generate(model, idx, steps, seed=seed, decoder="speculative", **SAMPLING)), dim=1)
    return collections.Counter(map(tuple, out.tolist()))


def accept_every_draft(p, q, drafts, generator):
    """A wrong rule, for the test's power: keep every draft and draw the bonus token from p."""
    bonus = torch.multinomial(p[:, -1], 1, generator=generator)
    return torch.cat([drafts, bonus], dim=1), torch.full_like(drafts[:, 0], drafts.shape[1])


def test_speculative_sampling_draws_from_plain_samplings_distribution(monkeypatch):
    """Speculative sampling (Leviathan et al. 2023) keeps the distribution: 6000 rows of one prompt, their first
    three tokens (the prefill's, then drafts accepted or redrawn) against the exact distribution of plain sampling
    at the same temperature, top-k and top-p (Pearson's chi-square, cells pooled below 5 expected). So large a
    batch advances in lockstep by its least-accepting row, one token a round: the next test covers longer
    acceptances. Accepting every draft instead fails the same test: the MTP modules' distributions differ from the
    main model's."""
    model = mtp_model(2, vocab_size=16)
    expected = plain_sampling_distribution(model, 3)
    n = 6000
    stat, p_value = chi_square(speculative_counts(model, n, seed=0, steps=3), expected, n)
    print(f"\nspeculative sampling: chi-square {stat:.1f} over {len(expected)} sequences, p-value {p_value:.3f}")
    assert p_value > 1e-3
    monkeypatch.setattr(speculative, "accept_drafts", accept_every_draft)
    _, wrong = chi_square(speculative_counts(model, 2000, seed=0, steps=3), expected, 2000)
    assert wrong < 1e-6


def test_speculative_sampling_at_temperature_zero_is_greedy():
    model = mtp_model(2)
    idx, mask = left_pad(PROMPTS)
    sampled = torch.stack(list(generate(model, idx, 20, temperature=0, top_k=5, top_p=0.9, seed=3,
                                        attention_mask=mask, decoder="speculative")))
    assert torch.equal(sampled, greedy(model, idx, mask, 20, "eager"))


def markov_speculation(rule, n: int, steps: int, seed: int) -> tuple[collections.Counter, list[int], dict]:
    """``rule`` (accept_drafts or a wrong one) on a target Markov chain P over 4 tokens drafted by another chain Q,
    D = 2, each of ``n`` rows committing its own accepted count + 1 tokens a round (no lockstep), until every row
    has ``steps`` tokens after token 0. Returns the counts of those first tokens, the accepted counts seen, and
    the chain's exact distribution of them."""
    V, D = 4, 2
    g = torch.Generator().manual_seed(seed)
    P, Q = (torch.softmax(torch.randn(V, V, generator=g) * 2, -1) for _ in range(2))  # (V, V) transitions
    buf, length = torch.zeros(n, steps + D + 1, dtype=torch.long), torch.zeros(n, dtype=torch.long)
    last, seen = torch.zeros(n, dtype=torch.long), []
    while int(length.min()) < steps:
        drafts, qs, x = [], [], last
        for _ in range(D):
            qs.append(Q[x])
            x = torch.multinomial(qs[-1], 1, generator=g).squeeze(-1)
            drafts.append(x)
        drafts = torch.stack(drafts, dim=1)  # (n, D)
        p = P[torch.cat([last[:, None], drafts], dim=1)]  # (n, D+1, V): p_j conditions on the token before slot j
        tokens, accepted = rule(p, torch.stack(qs, dim=1), drafts, g)
        seen += accepted.tolist()
        at = torch.arange(D + 1)
        write = (at <= accepted[:, None]) & (length[:, None] + at < buf.shape[1])
        rows, cols = write.nonzero(as_tuple=True)
        buf[rows, length[rows] + cols] = tokens[rows, cols]
        length = length + accepted + 1
        last = buf[torch.arange(n), (length - 1).clamp(max=buf.shape[1] - 1)]
    expected = {(a, b, c): float(P[0, a] * P[a, b] * P[b, c]) for a in range(V) for b in range(V) for c in range(V)}
    return collections.Counter(map(tuple, buf[:, :steps].tolist())), seen, expected


def test_the_acceptance_rule_alone_keeps_the_target_distribution_whatever_each_row_accepts():
    """accept_drafts with rows that advance independently (every accepted count committed, the bonus draw from p_D
    included, which a large lockstep batch rarely reaches): the first three tokens of a target Markov chain,
    drafted by another, against the chain's exact distribution (chi-square); accepting every draft fails it."""
    n = 20000
    counts, seen, expected = markov_speculation(speculative.accept_drafts, n, 3, seed=0)
    assert {0, 1, 2} <= set(seen)  # rejections at either draft, and whole rounds accepted
    stat, p_value = chi_square(counts, expected, n)
    print(f"\nacceptance rule alone: chi-square {stat:.1f} over {len(expected)} sequences, p-value {p_value:.3f}")
    assert p_value > 1e-3
    counts, _, expected = markov_speculation(accept_every_draft, n, 3, seed=0)
    assert chi_square(counts, expected, n)[1] < 1e-6
