"""The multi-candidate rule (backends.runtime.multi_candidate): on a synthetic two-position target with
draft laws of its own, the first two tokens that speculative sampling emits follow the target's
processed law (chi-square over 2 x 10^4 draws, total variation shrinking), for chains and trees, drafts
with and without draft probabilities, several temperatures, top-k and top-p; two deliberately
broken rules fail the same test. On the real default model: drawn Hydra drafts under
acceptance="match" equal one-node sampling, the rule is reproducible by seed, accepts drafts, and
stops at EOS inside an accepted draft and at the length limit."""

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
import torch

import specpass
from conftest import token_inside_an_accepted_draft
from specpass.backends.runtime import multi_candidate
from specpass.backends.runtime.multi_candidate import accept_drawn, node_laws
from specpass.backends.runtime.sampling import Sampling, TargetChoice
from specpass.drafters import Heads, accept_greedy
from specpass.drafters.tree import DraftLaw, DraftTree, Drawn
from specpass.rewrites import DraftHeads, TreeAttention
from test_sampling import _chi_square_p

DRAWS = 20_000  # the worst case's expected total variation is 0.012 (sd 0.002) at 2 x 10^4
V = 6
FIRST = torch.tensor([1.5, 1.0, 0.5, 0.0, -1.0, -3.0])  # [V]: the target's logits at position 1
SECOND = torch.tensor([[(a * b) % 5 - 2.0 + (b == a) for b in range(V)] for a in range(V)])  # [V, V]: p(. | a)
THIRD = torch.zeros(V)  # position 3 and on: not recorded


def _draft_law(logits: torch.Tensor) -> DraftLaw:
    """A draft law unlike the target's: flatter, with its own preferences, and zero on token 5."""
    q = (0.5 * logits.flip(0) + torch.arange(V) % 2).softmax(-1).double()
    q[5] = 0.0
    return DraftLaw(np.arange(V), (q / q.sum()).numpy())


def _logits(context: tuple[int, ...]) -> torch.Tensor:
    """The target's logits after `context` (the generated tokens so far)."""
    if not context:
        return FIRST
    return SECOND[context[0]] if len(context) == 1 else THIRD


def _key(context: tuple[int, ...]) -> tuple[int, ...]:
    """What the target and the draft read of the context: nothing, the first token, or nothing again."""
    return context if len(context) < 2 else (-1,)


class Synthetic:
    """The target's processed law and the draft law after every context, computed once per setting."""

    def __init__(self, sampling: Sampling):
        self.choice = TargetChoice(sampling=sampling)
        keys = [(), (-1,)] + [(a,) for a in range(V)]
        logits = torch.stack([_logits(k if k != (-1,) else (0, 0)) for k in keys])  # [K, V]
        probs = self.choice.processed(logits, [0]).double().softmax(-1).numpy()  # warpers read no ids
        self.target = dict(zip(keys, probs))
        self.laws = {k: _draft_law(row) for k, row in zip(keys, logits)}
        with np.errstate(divide="ignore"):
            self.log_laws = {law: np.log(law.probs) for law in self.laws.values()}  # -inf where q = 0
        self.likeliest = {law: np.argsort(-law.probs).tolist() for law in self.laws.values()}

    def tree(self, context: tuple[int, ...], widths: tuple[int, ...], drawn: bool, gumbel: "_Gumbel"
             ) -> tuple[DraftTree, list[tuple[int, ...]]]:  # fmt: skip
        """A tree after the generated `context` (the root is its last token): `widths[d]` children
        under every depth-d node, drawn from the node's draft law in draw order (drawn=True), or the
        law's likeliest tokens (drawn=False: probability-free drafts); and each node's context."""
        tokens, parents, drawn_nodes, contexts = [context[-1] if context else 0], [-1], [None], [context]
        frontier = [0]
        for width in widths:
            nxt = []
            for node in frontier:
                law = self.laws[_key(contexts[node])]
                chosen = _draws(self.log_laws[law], width, gumbel()) if drawn else self.likeliest[law][:width]
                for rank, j in enumerate(chosen):
                    tokens.append(int(law.tokens[j]))
                    parents.append(node)
                    drawn_nodes.append(Drawn(law, rank, j))
                    contexts.append(contexts[node] + (tokens[-1],))
                    nxt.append(len(tokens) - 1)
            frontier = nxt
        n = len(tokens)
        tree = DraftTree(tuple(tokens), tuple(parents), (1.0,) * n, (None,) * n, tuple(drawn_nodes) if drawn else ())
        return tree, contexts


class _Gumbel:
    """Rows of [V] Gumbel noise for the drafts' draws, drawn a block at a time (one numpy call per
    4096 rows, not one per node), from a generator of their own."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng([seed, 0x6472])
        self.block, self.next = np.empty((0, V)), 0

    def __call__(self) -> np.ndarray:
        if self.next == len(self.block):
            self.block, self.next = self.rng.gumbel(size=(4096, V)), 0
        self.next += 1
        return self.block[self.next - 1]


def _draws(log_law: np.ndarray, k: int, gumbel: np.ndarray) -> list[int]:
    """k draws without replacement from exp(log_law) (Gumbel-top-k), in draw order; indices into the law."""
    keys = log_law + gumbel
    order = np.argsort(-keys)[:k]
    return order[np.isfinite(keys[order])].tolist()


def _two_tokens(synthetic: Synthetic, widths, drawn: bool, rng, gumbel: _Gumbel, walk=accept_drawn, choice=None
                ) -> tuple[int, int]:  # fmt: skip
    """Speculative sampling of the first two tokens, step by step as the decode loop runs it: the
    multi-candidate rule (drawn drafts) or keyed sample-and-match (`choice`, probability-free drafts)."""
    context: tuple[int, ...] = ()
    while len(context) < 2:
        tree, contexts = synthetic.tree(context, widths[: 2 - len(context)], drawn, gumbel)
        if drawn:
            path, last = walk(tree, lambda node: synthetic.target[_key(contexts[node])], rng)
        else:
            logits = torch.stack([_logits(c) for c in contexts])  # [T, V]
            choices = choice(logits, [0, *context], tree.parents, tree.tokens).tolist()
            path = accept_greedy(tree, choices)
            last = choices[path[-1]]
        context += tuple(tree.tokens[i] for i in path[1:]) + (last,)
    return context[0], context[1]


def _target_pairs(synthetic: Synthetic) -> torch.Tensor:
    """p(a, b) = p(a) p(b | a) after the sampling's warpers: [V * V]."""
    first = synthetic.target[()]
    return torch.from_numpy(np.concatenate([first[a] * synthetic.target[(a,)] for a in range(V)]))


def _pair_counts(synthetic: Synthetic, widths, drawn: bool, n: int, walk=accept_drawn, seed: int = 0) -> torch.Tensor:
    rng, gumbel = np.random.default_rng(seed), _Gumbel(seed)
    counts = torch.zeros(V * V, dtype=torch.long)
    settings = {f: getattr(synthetic.choice.sampling, f) for f in Sampling.__dataclass_fields__}
    for s in range(n):
        choice = None if drawn else TargetChoice(sampling=Sampling(**(settings | {"seed": seed * n + s})))
        a, b = _two_tokens(synthetic, widths, drawn, rng, gumbel, walk, choice)  # keyed noise: one seed per sequence
        counts[a * V + b] += 1
    return counts


TREE, CHAIN = (3, 2), (1, 1)
CASES = [  # the four temperatures (1.0 on a chain, the others on trees), top-k, top-p, probability-free drafts
    (Sampling(do_sample=True, temperature=0.3), TREE, True),
    (Sampling(do_sample=True, temperature=0.7, top_k=3), TREE, True),
    (Sampling(do_sample=True, temperature=1.5, top_p=0.8), TREE, True),
    (Sampling(do_sample=True, temperature=1.0), CHAIN, True),  # T = 1.0 on a chain (trees: the others)
    (Sampling(do_sample=True, temperature=0.7, top_k=3), TREE, False),  # keyed: top-k (top-p: 0.65 vs 0.51 ms a draw)
]


def _case_counts(case: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair counts of CASES[case]: DRAWS sequences, and 500 more with other randomness for the
    total-variation check."""
    sampling, widths, drawn = CASES[case]
    synthetic = Synthetic(sampling)
    return _pair_counts(synthetic, widths, drawn, DRAWS), _pair_counts(synthetic, widths, drawn, 500, seed=1)


@pytest.fixture(scope="module")
def case_counts() -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Every case's counts, two cases at a time: each is a pure-Python loop on one core. The keyed
    case (probability-free drafts: a generator per position) is the longest and goes first."""
    order = sorted(range(len(CASES)), key=lambda case: CASES[case][2])
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {case: pool.submit(_case_counts, case) for case in order}
        return {case: future.result() for case, future in futures.items()}


@pytest.mark.parametrize(
    "case", range(len(CASES)),
    ids=[f"T{s.temperature}-k{s.top_k}-p{s.top_p}-{'tree' if w == TREE else 'chain'}-{'drawn' if d else 'free'}"
         for s, w, d in CASES],
)  # fmt: skip
def test_speculative_sampling_follows_the_target_over_two_tokens(case_counts, case):
    probs = _target_pairs(Synthetic(CASES[case][0]))
    counts, few = case_counts[case]
    assert counts.sum() == DRAWS and few.sum() == 500
    assert counts[probs == 0].sum() == 0  # nothing outside top-k / top-p
    assert _chi_square_p(counts, probs) > 1e-3
    tv = [0.5 * float((c / c.sum() - probs).abs().sum()) for c in (few, counts)]
    assert tv[1] < tv[0] and tv[1] < 0.02  # shrinks like plain sampling's, ~ 1 / sqrt(n)


def _no_residual(tree, target, rng):
    """Broken: a rejected draft leaves p as it was (no residual), so drafted tokens are over-sampled."""
    original = multi_candidate._accept_one

    def accept_one(tree, kids, p, rng):
        kid, _ = original(tree, kids, p, rng)
        return kid, p

    multi_candidate._accept_one = accept_one
    try:
        return accept_drawn(tree, target, rng)
    finally:
        multi_candidate._accept_one = original


def _with_replacement_law(tree, target, rng):
    """Broken: every draw is judged against the original q, as if drawn with replacement."""
    children: dict[int, list[int]] = {}
    for i in range(1, len(tree)):
        children.setdefault(tree.parents[i], []).append(i)
    path = [0]
    while True:
        p = target(path[-1])
        for kid in children.get(path[-1], []):
            law, index = tree.drawn[kid].law, tree.drawn[kid].index
            if rng.random() * law.probs[index] < p[tree.tokens[kid]]:
                path.append(kid)
                break
            p = np.maximum(p - law.probs, 0.0)
            p /= p.sum()
        else:
            return path, multi_candidate._sample(p, rng)


@pytest.mark.parametrize("walk", [_no_residual, _with_replacement_law])
def test_broken_rules_fail_the_same_test(walk):
    synthetic = Synthetic(Sampling(do_sample=True, temperature=1.0))
    counts = _pair_counts(synthetic, TREE, True, DRAWS, walk=walk)
    assert _chi_square_p(counts, _target_pairs(synthetic)) < 1e-3


class _Uniform:
    """An rng whose uniforms are fixed: forces an acceptance (0.0) or a rejection (just below 1)."""

    def __init__(self, value: float):
        self.value = value

    def random(self) -> float:
        return self.value


def test_edge_cases_of_the_rule():
    law = DraftLaw(np.arange(4), np.array([0.4, 0.3, 0.2, 0.1]))
    tree = DraftTree((9, 0, 1), (-1, 0, 0), (1.0,) * 3, (None,) * 3, (None, Drawn(law, 0, 0), Drawn(law, 1, 1)))
    # a residual of zero: p equal to q, a rejection forced by rounding -> the previous p without the draw
    p = law.probs.copy()
    kid, left = multi_candidate._accept_one(tree, [1, 2], p.copy(), _Uniform(1.0))
    assert kid is None and left[0] == left[1] == 0.0 and np.isclose(left.sum(), 1.0)
    assert np.allclose(left[2:], [2 / 3, 1 / 3])
    # p concentrated on one token: only that token comes out, drafted or not
    peaked = torch.full((3, 4), -torch.inf)
    peaked[:, 1] = 0.0
    rng = np.random.default_rng(0)
    assert all(accept_drawn(tree, node_laws(peaked), rng) == ([0, 2], 1) for _ in range(50))
    peaked[:, 1], peaked[:, 3] = -torch.inf, 0.0
    assert all(accept_drawn(tree, node_laws(peaked), rng) == ([0], 3) for _ in range(50))  # q had it, but never drew it
    # top_k = 1 is greedy
    choice = TargetChoice(sampling=Sampling(do_sample=True, top_k=1, temperature=1.5))
    for _ in range(20):
        logits = torch.randn(3, 4)
        greedy = logits.argmax(-1).tolist()
        path = accept_greedy(tree, greedy)
        assert accept_drawn(tree, node_laws(choice.processed(logits, [9], tree.parents, tree.tokens)), rng) == (path, greedy[path[-1]])
    # children that are not the first draws of one law are refused
    skipped = DraftTree((9, 0), (-1, 0), (1.0,) * 2, (None,) * 2, (None, Drawn(law, 1, 0)))
    with pytest.raises(ValueError, match="first draws of one draft law"):
        accept_drawn(skipped, node_laws(torch.zeros(2, 4)), rng)


def test_drawn_heads_refusals():
    with pytest.raises(specpass.InvalidParameterError, match="tree='static'"):
        Heads(temperature=1.0)
    with pytest.raises(specpass.InvalidParameterError, match="temperature"):
        Heads(tree="static", temperature=0.0)
    with pytest.raises(specpass.InvalidParameterError, match="cannot share a tree"):
        specpass.drafters.Combined(Heads(tree="static", temperature=1.0), specpass.drafters.PromptLookup())
    with pytest.raises(specpass.InvalidParameterError, match="acceptance"):
        Sampling(do_sample=True, acceptance="typical")
    with pytest.raises(specpass.InvalidParameterError, match="only takes effect when sampling"):
        Sampling(acceptance="match")


def _drawn_hydra() -> dict:
    """Drawn Hydra drafts on trees of 16 nodes: under the rule the tokens depend on the tree, so a run
    repeats only with trees that do not follow measured timings (the cost budget's)."""
    return {"pipeline": specpass.Pipeline(TreeAttention(64), DraftHeads("hydra")), "budget": 16,
            "drafter": Heads(tree="static", temperature=1.0)}  # fmt: skip


def test_drawn_drafts_on_the_default_model(default_model, cases):
    """acceptance="match" keeps keyed sample-and-match for drawn drafts: the tokens equal one-node
    sampling with the same seed. The rule ("auto") gives the same tokens for the same seed, other
    tokens for another seed, accepts drafts, and stops inside an accepted draft and at the length limit."""
    model, _ = default_model
    program = specpass.compile_program(model, _drawn_hydra())
    plain = {"budget": 1, "pipeline": specpass.Pipeline(TreeAttention(1))}
    taus = []
    for i, (ids, _) in enumerate((cases[0], cases[3])):  # a code prompt and a chat prompt
        settings = dict(do_sample=True, temperature=0.7, top_p=0.9, seed=i)
        reference = specpass.generate(model, ids, 32, options=plain, **settings)
        assert torch.equal(specpass.generate(program, ids, 32, acceptance="match", **settings).sequences, reference.sequences)
        taus.append(specpass.generate(program, ids, 32, **settings).stats.tau)
    ids, _ = cases[0]
    settings = dict(do_sample=True, temperature=0.3, seed=3)
    full = specpass.generate(program, ids, 40, **settings)
    taus.append(full.stats.tau)
    assert sum(taus) / len(taus) > 1.1  # drawn drafts are accepted
    assert torch.equal(specpass.generate(program, ids, 40, **settings).sequences, full.sequences)
    assert not torch.equal(specpass.generate(program, ids, 40, **(settings | {"seed": 4})).sequences, full.sequences)
    eos, position = token_inside_an_accepted_draft(full.sequences[0, ids.shape[1] :].tolist(), full.stats.steps)
    out = specpass.generate(program, ids, 40, eos_token_id=eos, **settings)
    assert torch.equal(out.sequences[0], full.sequences[0, : ids.shape[1] + position + 1])
    assert out.stats.finish_reason == "eos"
    short = specpass.generate(program, ids, 5, **settings)
    assert short.stats.new_tokens == 5 and short.stats.finish_reason == "length"
