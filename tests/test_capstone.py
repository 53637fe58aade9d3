"""Module 7's capstone: the data, its floor and the n-gram ladder, the accumulation guide's loop, and the learner's
training program with dmuon on 2 ranks (module 7b)."""

import json
import math

import pytest
import torch

from dmuon_edu.course import capstone, capstone_program, capstone_sweep, notebooks
from dmuon_edu.course.capstone import (counted_bytes_per_step, local_microbatches, run_single_process,
                                       single_process_optimizers, train)
from dmuon_edu.course.capstone_problem import NGRAMS, Capstone, ngram_loss
from dmuon_edu.course.checks import recorded_script_results, run_check
from dmuon_edu.compare import max_parameter_difference
from dmuon_edu.course.data import MarkovSource, context_numbers
from dmuon_edu.course.gpt import is_hidden_matrix
from dmuon_edu.launch import torchrun
from dmuon_edu.newton_schulz import NS_DTYPE_ENV

SHORT = Capstone(steps=30)
PROGRAM = notebooks.SOLUTION_SCRIPTS / "07_train_capstone.py"


def test_the_entropy_rate_of_a_two_state_chain_has_its_closed_form():
    # P = [[1-a, a], [b, 1-b]]: stationary (b, a) / (a + b), so H = (b h(a) + a h(b)) / (a + b),
    # h the binary entropy. Weighting rows equally, or by the wrong eigenvector, gives other numbers.
    a, b = 0.1, 0.3
    h = lambda q: -q * math.log(q) - (1 - q) * math.log(1 - q)  # noqa: E731
    source = MarkovSource(torch.tensor([[1 - a, a], [b, 1 - b]], dtype=torch.float64))
    assert source.entropy_rate() == pytest.approx((b * h(a) + a * h(b)) / (a + b), rel=1e-12)  # float64 sums


def copy_two_back(vocab: int, eps: float) -> MarkovSource:
    """Order 2: the next token repeats the one two back with probability 1 - eps, else one of the other V - 1."""
    table = torch.full((vocab, vocab, vocab), eps / (vocab - 1), dtype=torch.float64)
    for a in range(vocab):
        table[a, :, a] = 1 - eps
    return MarkovSource(table)


def test_a_copy_two_back_chain_has_its_closed_form_floors():
    # Its stationary distribution is uniform (the chain on pairs is doubly stochastic), so the entropy rate
    # is h(eps) + eps log(V - 1), and the previous token alone says nothing: a bigram's floor is log V.
    vocab, eps, seq_len = 5, 0.2, 8
    source = copy_two_back(vocab, eps)
    rate = -(1 - eps) * math.log(1 - eps) - eps * math.log(eps / (vocab - 1))
    assert source.stationary() == pytest.approx(torch.full((vocab**2,), 1 / vocab**2, dtype=torch.float64), abs=1e-12)
    assert source.entropy_rate() == pytest.approx(rate, rel=1e-12)  # float64 sums
    floors = source.position_floors(seq_len)
    assert floors.tolist() == pytest.approx([math.log(vocab)] + [rate] * (seq_len - 1), rel=1e-12)


def test_a_second_order_chain_that_ignores_the_older_token_is_the_first_order_chain():
    first_order = MarkovSource.random(3, seed=4)
    second_order = MarkovSource(first_order.transition.expand(3, 3, 3).contiguous())
    assert second_order.entropy_rate() == pytest.approx(first_order.entropy_rate(), rel=1e-12)
    pairs = second_order.stationary().reshape(3, 3)
    assert pairs.sum(dim=1) == pytest.approx(first_order.stationary(), abs=1e-12)
    assert pairs == pytest.approx(first_order.stationary()[:, None] * first_order.transition, abs=1e-12)


def test_the_floors_agree_with_counts_from_an_independent_sampler():
    # An independent sampler: inverse-CDF draws from the table, 16000 chains from uniform starts, the
    # first 140 steps dropped (the chain on triples has second eigenvalue 0.93 in modulus: 0.93^140 < 1e-4
    # of the start is left). Plug-in conditional entropies from 16000 x 60 = 1e6 counted windows: their
    # bias is about 1e-4 (contexts x (V - 1) / 2N) and their standard error about 1e-3, so 5e-3 fails any
    # formula off by more than a few thousandths of a nat, such as unweighted rows (0.05 off here).
    source = Capstone().source()
    vocab, k = source.vocab_size, source.order
    cdf = source.transition.cumsum(dim=-1)
    generator = torch.Generator().manual_seed(123)
    chains, burn_in, kept = 16000, 140, 60
    columns = list(torch.randint(vocab, (k, chains), generator=generator))
    for _ in range(burn_in + kept):
        u = torch.rand(chains, 1, generator=generator, dtype=torch.float64)
        row = cdf[columns[-3], columns[-2], columns[-1]]
        columns.append(torch.searchsorted(row, u).squeeze(1).clamp_max(vocab - 1))
    text = torch.stack(columns[burn_in:], dim=1)

    def counts(width):  # how often each run of `width` tokens occurs, numbered in base V
        windows = text.unfold(1, width, 1)
        return torch.bincount(context_numbers(windows, vocab).flatten(), minlength=vocab**width).double()

    def conditional_entropy(width):  # H(next | the width - 1 tokens before it), plug-in
        h = lambda c: -((c / c.sum())[c > 0] * (c / c.sum())[c > 0].log()).sum().item()  # noqa: E731
        return h(counts(width)) - h(counts(width - 1))

    assert conditional_entropy(k + 1) == pytest.approx(source.entropy_rate(), abs=5e-3)
    floors = source.position_floors(k)
    for t in range(k - 1):  # H(X_1 | X_0), H(X_2 | X_0, X_1): what the first predictions can know
        assert conditional_entropy(t + 2) == pytest.approx(float(floors[t]), abs=5e-3)
    assert counts(k) / counts(k).sum() == pytest.approx(source.stationary(), abs=5e-3)  # 64 frequencies, SE < 4e-4


def test_the_capstone_source_copies_the_token_three_back_or_follows_a_chain():
    table, chain = Capstone().source().transition, MarkovSource.random(4, seed=0, sharpness=2.5).transition
    a, b, c, j = 2, 0, 1, 3
    assert table[a, b, c, j].item() == pytest.approx(0.3 * chain[c, j].item(), abs=1e-15)  # float64, one product
    assert table[a, b, c, a].item() == pytest.approx(0.7 + 0.3 * chain[c, a].item(), abs=1e-15)


def test_no_table_up_to_the_trigram_reaches_the_floor_and_the_gpt_with_muon_does():
    # The capstone's claim: every n-gram table of n <= 3 ends at least 0.1 nats above the floor, and the
    # GPT with Muon, at the notebook's settings, within 0.05 (measured: the trigram 0.34 above, the GPT 0.01).
    # A 4-gram table has the source's own shape and reaches the floor, within the held-out text's noise and
    # its smoothing (measured -0.004).
    settings = Capstone()
    floor, batches, held_out = settings.floor(), settings.microbatches(), settings.held_out()
    above = {NGRAMS[n]: ngram_loss(n, batches, held_out, settings.vocab_size) - floor for n in NGRAMS}
    assert min(above["unigram"], above["bigram"], above["trigram"]) >= 0.1, above
    assert above["unigram"] > above["bigram"] > above["trigram"], above  # each token of context helps
    assert abs(above["4-gram"]) < 0.02, above
    result = run_single_process(settings, "Muon", progress=False)
    assert result.held_out_loss - floor < 0.05, result.held_out_loss - floor
    assert result.losses[0] > math.log(settings.vocab_size) - 0.1  # it starts from a near-uniform guess
    learned = torch.tensor(result.learned_rows, dtype=torch.float64)
    assert learned.shape == (settings.vocab_size**settings.order, settings.vocab_size)
    seen = torch.bincount(settings.source().context_index(held_out[:, :-1]).flatten(), minlength=len(learned)) > 0
    # A context the held-out text never shows (a few are rarer than 1e-4) has no learned row: zeros.
    assert torch.allclose(learned[seen].sum(dim=1), torch.ones(int(seen.sum()), dtype=torch.float64))
    assert torch.equal(learned[~seen], torch.zeros_like(learned[~seen]))


def test_ngram_tables_count_each_context_length_where_it_is_used():
    # Two training sequences of 4 tokens, 3 predictions each, V = 2. A bigram table, add-one smoothed:
    # after 0 the next token is 1 three times of three (4/5 with smoothing); after 1 it is 0 once and 1
    # twice (2/5, 3/5). The held-out "0 1 1 0" makes the predictions 0->1, 1->1, 1->0.
    training = [(torch.tensor([[0, 1, 0], [0, 1, 1]]), torch.tensor([[1, 0, 1], [1, 1, 1]]))]
    held_out = torch.tensor([[0, 1, 1, 0]])
    bigram = -(math.log(4 / 5) + math.log(3 / 5) + math.log(2 / 5)) / 3
    assert ngram_loss(2, training, held_out, 2) == pytest.approx(bigram, rel=1e-12)  # float64, three logs
    # A unigram table: frequencies of the six targets (1 five times, 0 once), add-one: 6/8 and 2/8.
    unigram = -(2 * math.log(6 / 8) + math.log(2 / 8)) / 3
    assert ngram_loss(1, training, held_out, 2) == pytest.approx(unigram, rel=1e-12)
    # A trigram table: prediction 0 has seen one token and uses the counts of position 0 alone (after 0:
    # 1 twice of two, 3/4 smoothed); predictions 1 and 2 the two tokens before: (0,1) -> 0 once and 1
    # once (2/4 each), (1,0) -> 1 once, (1,1) -> 1 once (0 has 1/3). Held out: 3/4, 2/4, 1/3.
    trigram = -(math.log(3 / 4) + math.log(2 / 4) + math.log(1 / 3)) / 3
    assert ngram_loss(3, training, held_out, 2) == pytest.approx(trigram, rel=1e-12)
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        ngram_loss(0, training, held_out, 2)


def test_next_token_distributions_start_with_the_stationary_conditionals_then_the_rows():
    source = Capstone().source()
    vocab = source.vocab_size
    inputs = source.sample(3, 6, torch.Generator().manual_seed(0))
    truth = source.next_token_distributions(inputs)
    pi = source.stationary()
    for t in range(source.order - 1):  # P(X_t+1 | X_0 ... X_t), from pi's first t + 2 tokens
        joint = pi.reshape(vocab ** (t + 2), -1).sum(dim=1).reshape(vocab ** (t + 1), vocab)
        rows = joint[context_numbers(inputs[:, : t + 1], vocab)]
        assert truth[:, t] == pytest.approx(rows / rows.sum(dim=1, keepdim=True), abs=1e-12)
    for t in range(source.order - 1, inputs.shape[1]):
        assert torch.equal(truth[:, t], source.transition[inputs[:, t - 2], inputs[:, t - 1], inputs[:, t]])


def test_excess_loss_is_zero_for_the_truth_and_averaging_can_only_lower_the_kl():
    source = Capstone().source()
    tokens = source.sample(256, 9, torch.Generator().manual_seed(1))
    truth = source.next_token_distributions(tokens[:, :-1])
    exact = capstone.excess_loss(source, tokens, truth)
    assert all(abs(value) < 1e-12 for name, value in exact.items() if name != "noise_se")
    # The same text twice, predicted off by +d the first time and -d the second: in every context the
    # averaged prediction is the truth (zero KL), while each prediction is off (positive KL).
    twice = torch.cat([tokens, tokens])
    d = 0.5 * truth.min(dim=-1, keepdim=True).values * torch.tensor([1.0, -1.0, 0.0, 0.0], dtype=torch.float64)
    measured = capstone.excess_loss(source, twice, torch.cat([truth + d, truth - d]))
    assert measured["kl_of_mean_rows"] < 1e-12 and measured["mean_kl_full_context"] > 1e-4


def test_a_shorter_run_trains_on_the_first_micro_batches_of_a_longer_one():
    short, long = Capstone(steps=2).microbatches(), Capstone(steps=5).microbatches()
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(short, long))
    other_seed = Capstone(steps=2, seed=1)
    assert not torch.equal(other_seed.microbatches()[0][0], short[0][0])
    assert torch.equal(other_seed.held_out(), Capstone(steps=2).held_out())  # every run is evaluated on the same text


def test_each_rank_takes_an_equal_share_of_every_global_micro_batch():
    batches = SHORT.microbatches()
    assert len(batches) == SHORT.steps * SHORT.accum_steps
    assert batches[0][0].shape == (SHORT.global_microbatch, SHORT.seq_len)
    shares = [local_microbatches(batches, rank, 2) for rank in range(2)]
    for i, (inputs, targets) in enumerate(batches):
        assert torch.equal(torch.cat([shares[0][i][0], shares[1][i][0]]), inputs)
        assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are the next tokens
    with pytest.raises(ValueError, match="does not split evenly over 3 ranks"):
        local_microbatches(batches, 0, 3)


def test_an_accumulated_step_equals_one_full_batch_step():
    settings = Capstone(steps=3)
    accumulated, full = settings.model(), settings.model()
    batches = settings.microbatches()
    whole = [tuple(torch.cat(parts) for parts in zip(*batches[i:i + settings.accum_steps]))
             for i in range(0, len(batches), settings.accum_steps)]
    train(accumulated, single_process_optimizers("AdamW", accumulated, settings), batches, settings.accum_steps)
    train(full, single_process_optimizers("AdamW", full, settings), whole, 1)
    # Two half-batch gradients added against one full-batch sum: float32 sums in another order, which
    # AdamW amplifies where a gradient component nearly cancels (its m / sqrt(v) divides by that component).
    # Measured 8e-6 (AVX-512 kernels), 1.1e-5 (torch's default kernels) and 1.5e-5 (AVX2). The mistakes
    # this guards against move parameters 27 to 6000 times further: an unscaled loss by 2.7e-3 (AdamW
    # forgives all of it but eps), a dropped micro-batch by 5.8e-2, a step every micro-batch by 8.4e-2.
    assert max_parameter_difference(accumulated, full) < 1e-4


def test_a_stored_point_of_the_sweep_is_reproduced():
    stored = next(run for run in capstone_sweep.load()["runs"]
                  if (run["optimizer"], run["lr"], run["seed"]) == ("Muon", 0.02, 1))
    steps = 5
    rerun = capstone_sweep.run_point("Muon", 0.02, 1, steps=steps)
    # The same code on the same batches. The first steps are not chaotic yet: other kernels, and float32
    # against bf16 Newton-Schulz, move them by 1.3e-4 (measured over these 5 steps). Halving the learning
    # rate moves them by 5.8e-3, so 1e-3 tells a stale sweep from rounding on any CPU.
    assert rerun["losses"] == pytest.approx(stored["losses"][:steps], abs=1e-3)


def test_the_sweep_records_its_kernel_sets_and_marks_the_chaotic_points():
    sweep = capstone_sweep.load()
    assert list(sweep["kernel_sets"]) == list(capstone_sweep.KERNEL_SETS)
    assert len({(k["cpu_capability"], k["ns_dtype"]) for k in sweep["kernel_sets"].values()}) == 2  # two kernel sets, not one twice
    for run in sweep["runs"]:
        results = run["held_out_by_kernel_set"].values()
        assert run["stable"] == (max(results) - min(results) < capstone_sweep.STABLE_TOLERANCE), run["lr"]
        assert run["held_out_by_kernel_set"]["this machine"] == run["held_out_loss"]
    stable = {(r["optimizer"], r["lr"], r["seed"]) for r in sweep["runs"] if r["stable"]}
    assert {("AdamW", 0.003, 0), ("Muon", 0.02, 0)} <= stable  # the points module 7's section 3 compares with
    assert ("AdamW", 0.03, 0) not in stable  # it is chaotic: 0.485 above the floor on one kernel set, 0.474 on the other


def test_the_kernel_set_says_what_this_process_computes_with(monkeypatch):
    monkeypatch.setenv(NS_DTYPE_ENV, "float32")
    assert capstone_sweep.kernel_set() == {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "ns_dtype": "float32"}


def test_held_bytes_counts_parameters_and_optimizer_state():
    model = SHORT.model()
    optimizers = single_process_optimizers("AdamW", model, SHORT)
    train(model, optimizers, SHORT.microbatches()[:2], SHORT.accum_steps)
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert capstone.held_bytes(model, []) == parameter_bytes
    assert capstone.held_bytes(model, optimizers) >= 3 * parameter_bytes  # + exp_avg and exp_avg_sq


def test_unknown_optimizer_names_the_known_ones():
    with pytest.raises(ValueError, match="use one of"):
        single_process_optimizers("SGD", SHORT.model(), SHORT)


def test_predicted_bytes_follow_module_6():
    assert counted_bytes_per_step(100, 4, zero3=True, no_sync=True) == {"broadcast": 800, "reduce": 100}
    assert counted_bytes_per_step(100, 4, zero3=False, no_sync=True) == {"broadcast": 100, "reduce": 100}
    assert counted_bytes_per_step(100, 4, zero3=False, no_sync=False) == {"broadcast": 100, "reduce": 400}


@pytest.mark.parametrize("predicate, status, hint", [
    (lambda n, p: p.ndim == 2 and "embed" not in n and "head" not in n, "PASS", "on both models"),
    (lambda n, p: p.ndim == 2 and not n.endswith(("embedding.weight", "embed.weight", "head.weight")), "PASS",
     "on both models"),
    (is_hidden_matrix, "FAIL", "the package's own is_hidden_matrix"),
    (lambda n, p: n.endswith("_proj.weight"), "FAIL", "on EncoderLM: encoder.layers.0.linear1.weight (and 5 more) "
                                                       "is a hidden matrix"),
    (lambda n, p: "proj" in n and p.ndim == 2, "FAIL", "on EncoderLM: encoder.layers.0.linear1.weight"),
    (lambda n, p: p.ndim == 2, "FAIL", "on GPT: you selected pos_embedding.weight, an embedding table"),
    (lambda n, p: p.ndim == 2 and "embedding" not in n, "FAIL", "on GPT: you selected lm_head.weight"),
    (lambda n, p: p.ndim == 2 and "embedding" not in n and "lm_head" not in n, "FAIL",
     "on EncoderLM: you selected embed.weight"),
    (lambda n, p: "proj" in n, "FAIL", "1-D"),
    (lambda n, p: "mlp" in n and p.ndim == 2, "FAIL", "not selected"),
])
def test_the_predicate_check_names_the_mistake(predicate, status, hint):
    result = run_check("is_hidden_matrix", predicate)
    assert result.status == status and hint in result.message


@pytest.mark.torchrun
def test_the_benchmarks_dmuon_runs_send_and_hold_what_module_6_predicts(tmp_path):
    # make bench's rows of counted bytes come from these runs; the learner's program (below) covers Z3 with no_sync
    steps = 2
    path = tmp_path / "capstone.json"
    torchrun(capstone.__file__, nproc=2, args=[path, "--steps", steps, "--modes", "Z2", "Z3 without no_sync"],
             echo=False, timeout=120)
    results = json.loads(path.read_text())
    reference = run_single_process(Capstone(steps=steps), "Muon", progress=False)
    for mode, result in results.items():
        assert result["comm_per_step"]["broadcast"][1] == result["predicted_per_step"]["broadcast"], mode
        assert result["comm_per_step"]["reduce"][1] == result["predicted_per_step"]["reduce"], mode
        # bf16 Newton-Schulz on both sides; the sums run in another order.
        assert result["losses"] == pytest.approx(reference.losses, abs=2e-2), mode
        assert all(held < reference.held_bytes for held in result["held_bytes_per_rank"]), mode
    p_m, k = results["Z2"]["P_M"], Capstone().accum_steps
    assert results["Z2"]["matrix_bytes_during_forward_per_rank"] == [p_m, p_m]  # Z2 keeps every matrix
    assert results["Z2"]["matrix_gradient_bytes_during_forward_per_rank"] == [p_m, p_m]  # no_sync: every gradient
    assert all(b < p_m for b in results["Z3 without no_sync"]["matrix_gradient_bytes_during_forward_per_rank"])
    assert results["Z3 without no_sync"]["comm_per_step"]["reduce"][1] == k * p_m


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    """The solution of module 7b's training program on 2 ranks: its report, as notebook 7b's check cell recorded
    it in this `make test` (checks.recorded_script_results), or from a launch of its own."""
    if (report := recorded_script_results(PROGRAM, 2)) is None:
        path = tmp_path_factory.mktemp("program") / "capstone.json"
        torchrun(PROGRAM, nproc=2, args=[path], echo=False, timeout=180)
        report = json.loads(path.read_text())
    return report["measurements"] | {"status": report["status"]}


@pytest.mark.torchrun
def test_the_learners_program_follows_single_process_muon_at_every_step_and_resumes_exactly(program):
    assert program["status"] == "PASS"
    assert len(program["losses"]) == len(program["reference_losses"]) == Capstone().steps
    # float32 Newton-Schulz on both sides, the sums in another order: measured 1.1e-6 apart at most
    assert program["losses"] == pytest.approx(program["reference_losses"], abs=1e-5)
    assert program["resume_returned"] == program["save_after"] == 100
    assert program["resumed_losses"] == program["losses"][100:] and program["resumed_exactly"]
    assert program["held_out_loss"] - Capstone().floor() < capstone_program.MARGIN


@pytest.mark.torchrun
def test_the_learners_program_sends_and_holds_what_module_6_predicts(program):
    model = Capstone().model()
    p_m = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if is_hidden_matrix(n, p))
    world, layers, k = 2, Capstone().n_layer, Capstone().accum_steps
    assert program["P_M"] == p_m
    # the solution's Z3: 2N P_M broadcast a step, and with no_sync one reduce of P_M
    assert program["comm_per_step"]["broadcast"][1] == 2 * k * p_m
    assert program["comm_per_step"]["reduce"][1] == p_m
    # inside no_sync every rank accumulates the gradient of every dedicated matrix
    assert program["matrix_gradient_bytes_during_forward_per_rank"] == [p_m] * world
    # Z3 holds its own matrices, and while a layer runs that layer's (its equal layers are owned whole, one per
    # rank here): at most P_M / W + P_M / L, where Z2 holds P_M through the window
    during_forward = program["matrix_bytes_during_forward_per_rank"]
    assert all(p_m // world <= b <= p_m // world + p_m // layers for b in during_forward)
    one_process = run_single_process(Capstone(steps=2), "Muon", progress=False).held_bytes
    assert all(held < one_process for held in program["held_bytes_per_rank"])


def test_the_schedule_warms_up_then_falls_to_a_tenth():
    factors = [capstone_program.lr_factor(step, 120) for step in range(121)]
    assert factors[0] == pytest.approx(0.1) and factors[capstone_program.WARMUP - 1] == 1.0
    assert factors[capstone_program.WARMUP] == 1.0 and factors[120] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors[capstone_program.WARMUP:], factors[capstone_program.WARMUP + 1:]))


def test_the_layout_is_read_from_the_bytes():
    p_m, k = 1000, 2
    fsdp = {"all_gather": [1, 10], "reduce": [1, p_m]}
    assert capstone_program.layout_of(fsdp | {"broadcast": [8, 2 * k * p_m]}, p_m, k) == "Z3"
    assert capstone_program.layout_of(fsdp | {"broadcast": [2, p_m]}, p_m, k) == "Z2"
    assert capstone_program.layout_of({"all_reduce": [1, 10], "broadcast": [2, p_m]}, p_m, k) == "the DDP backend"
    assert capstone_program.layout_of(fsdp | {"broadcast": [4, k * p_m]}, p_m, k) is None


@pytest.mark.parametrize("arguments, error, words", [
    (dict(steps=12, save_after=12), ValueError, "save_after must be an int between 1 and 11"),
    (dict(steps=12, save_after=0), ValueError, "save_after must be an int between 1 and 11"),
    (dict(steps=1, save_after=1), ValueError, "steps must be an int >= 2"),
    (dict(steps=12.0), TypeError, "steps must be an int"),
])
def test_a_program_run_that_cannot_save_and_resume_is_refused(arguments, error, words):
    with pytest.raises(error, match=words):
        capstone_program.ProgramRun(**arguments)


def test_the_schedule_refuses_a_negative_step():
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        capstone_program.lr_factor(-1, 120)
