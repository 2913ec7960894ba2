"""Items on training across slow links and failures (chapter 11): DiLoCo, HSDP, per-step fault tolerance, checkpoint intervals, stragglers.

Answers are computed by :mod:`engine.theory` (numeric items) or settled by a measurement in
the chapter (choice items); every item names the chapter section that teaches it.
"""

from __future__ import annotations

from engine import theory
from engine.drill.items import Choice, Numeric, Outline

TOPIC = "slow links and failures"
C11 = "course/11_slow_links.ipynb"
HSDP = (C11, "HSDP: shard inside a site, replicate across sites")
DILOCO = (C11, "DiLoCo: H local steps, then one outer step")
STREAMING = (C11, "Streaming DiLoCo: fragments cut the peak")
FT = (C11, "Per-step fault tolerance: a replica group dies and rejoins")
INTERVAL = (C11, "How often to checkpoint: Young and Daly")
STRAGGLER = (C11, "Finding a straggler")
ANSWER = (C11, "The interview answer, in 30 seconds")
HOUR = 3600.0


# -- numeric: every answer from engine.theory at drawn parameters ----------------------------

def _diloco_saving(rng):
    h, n = rng.choice([10, 50, 100, 500]), rng.choice([4, 8, 16])
    numel, steps = 1e9, 10 * h
    ddp = steps * theory.ring_all_reduce_bytes(numel * 4, n)
    diloco = theory.diloco_bytes(numel, steps, h, n, 4)
    return (f"DiLoCo with H = {h} inner steps between syncs, {n} replicas, fp32 pseudo-gradients:"
            f" over {steps} steps, how many times fewer bytes does a replica send than data "
            "parallelism (one all-reduce per step)?", ddp / diloco,
            "Both send a ring all-reduce of the whole model, 2(n-1)/n x 4 bytes x P; DDP every "
            "step, DiLoCo every H steps: H times fewer (2H with a bf16 outer all-reduce).")


def _diloco_sync_gb(rng):
    billions, n = rng.choice([1, 7, 13, 70]), rng.choice([2, 4, 8])
    sent = theory.diloco_peak_sync_bytes(billions * 1e9, n, 4)
    return (f"One DiLoCo sync of a {billions}B-parameter model among {n} replicas, fp32 "
            "pseudo-gradients, ring all-reduce: how many GB does each replica send?", sent / 1e9,
            "2(n-1)/n x P x 4 bytes: the whole pseudo-gradient, once every H steps.")


def _streaming_peak_gb(rng):
    billions, n, f = rng.choice([7, 13, 70]), rng.choice([2, 4, 8]), rng.choice([2, 4, 8])
    sent = theory.diloco_peak_sync_bytes(billions * 1e9, n, 2, f)
    return (f"Streaming DiLoCo, {billions}B parameters cut into {f} fragments, {n} replicas, "
            "bf16 pseudo-gradients: how many GB does each replica send in one fragment's sync "
            "(the peak)?", sent / 1e9,
            "2(n-1)/n x P/F x 2 bytes: the same total as DiLoCo, spread over F staggered syncs "
            "(Douillard et al., 2025).")


def _diloco_syncs(rng):
    h, f = rng.choice([(8, 2), (12, 4), (100, 4), (50, 5), (30, 3)])
    steps = rng.choice([3, 5, 10]) * h + rng.choice([0, h // 2])
    count = sum(theory.diloco_syncs(steps, h, f))
    return (f"Streaming DiLoCo with H = {h} and {f} fragments: fragment p syncs at the steps t "
            f"with t = (p+1)H/F (mod H). How many fragment syncs in {steps} inner steps, all "
            "fragments together?", count,
            "Each fragment syncs once every H steps, the first at step (p+1)H/F: count them.")


def _hsdp_mb(rng):
    millions, s, r = rng.choice([125, 350, 1300]), rng.choice([4, 8]), rng.choice([2, 4, 8])
    sent = theory.hsdp_replica_bytes(millions * 1e6, s, r, 4)
    return (f"HSDP: a {millions}M-parameter model sharded over {s} ranks inside each site, "
            f"replicated over {r} sites, fp32 gradients. How many MB does each rank send across "
            "the sites per step?", sent / 1e6,
            "Each rank all-reduces only its reduce-scattered shard across the replica groups: "
            "2(R-1)/R x P/S x 4 bytes.")


def _hsdp_cut(rng):
    s, r = rng.choice([2, 4, 8, 16]), rng.choice([2, 4, 8])
    numel = 1e9
    ddp = theory.ring_all_reduce_bytes(numel * 4, r)
    return (f"HSDP with {s} ranks per shard group and {r} replica groups vs data parallelism "
            "across the same slow links: how many times fewer bytes does each rank send over "
            "them per step?", ddp / theory.hsdp_replica_bytes(numel, s, r, 4),
            "DDP all-reduces the whole gradient across the replicas; HSDP only the 1/S shard "
            "each rank holds after the reduce-scatter inside its group.")


def _ft_cross_mb(rng):
    millions, g = rng.choice([100, 350, 1300]), rng.choice([2, 4, 8])
    total = rng.choice([4, 8])
    live = total - 1
    sent = theory.hsdp_replica_bytes(millions * 1e6, g, live, 4)
    return (f"Per-step fault tolerance: {total} replica groups of {g} ranks train a "
            f"{millions}M-parameter model (fp32 gradients). Each group first reduces its "
            f"gradient inside (HSDP's shape, as engine.ft does), so each of its G = {g} ranks "
            "holds a 1/G slice of the group's gradient, and all-reduces only that slice across "
            "the groups. One group has died, so the quorum holds the others. How many MB does "
            "each rank send across the groups this step?",
            sent / 1e6,
            "Inside a group the gradient is reduced first (HSDP reduce-scatters it; engine.ft "
            "all-reduces it and keeps its slice: the same bytes cross the groups); each rank "
            "all-reduces its 1/G slice with the same slice of the live groups only: "
            "2(L-1)/L x P/G x 4 bytes.")


def _young_multiple(rng):
    c, hours = rng.choice([30, 60, 120, 300]), rng.choice([1, 4, 12, 24])
    t = theory.young_checkpoint_interval(c, hours * HOUR)
    return (f"A checkpoint costs {c} s and the job fails every {hours} h on average. Young's "
            "checkpoint interval is how many times the checkpoint's cost?", t / c,
            "T* = sqrt(2 C M) (Young, 1974), so T*/C = sqrt(2M/C).")


def _young_waste(rng):
    c, hours = rng.choice([30, 60, 120, 300]), rng.choice([1, 4, 12, 24])
    m = hours * HOUR
    waste = theory.checkpoint_waste(theory.young_checkpoint_interval(c, m), c, m)
    return (f"Checkpoints cost {c} s, failures come every {hours} h on average, and you "
            "checkpoint at Young's interval. To first order, what share of the time is wasted "
            "(checkpoints plus lost work)?", 100 * waste,
            "C/T + T/(2M) at T = sqrt(2CM) is sqrt(2C/M).")


def _waste_too_often(rng):
    c, hours, k = rng.choice([30, 60, 120]), rng.choice([4, 12, 24]), rng.choice([4, 10])
    m = hours * HOUR
    young = theory.young_checkpoint_interval(c, m)
    ratio = theory.checkpoint_waste(young / k, c, m) / theory.checkpoint_waste(young, c, m)
    return (f"Checkpoints cost {c} s, failures come every {hours} h. You checkpoint {k} times "
            "more often than Young's interval. How many times the least waste do you waste "
            "(first order)?", ratio,
            "C/T + T/(2M) at T*/k is (k + 1/k)/2 times its minimum.")


def _daly_over_young(rng):
    c, minutes = rng.choice([60, 300, 600, 1200]), rng.choice([30, 60, 120])
    m = minutes * 60.0
    return (f"A checkpoint costs {c} s and failures come every {minutes} min. Daly's "
            "higher-order interval is what fraction of Young's sqrt(2CM)?",
            theory.daly_checkpoint_interval(c, m) / theory.young_checkpoint_interval(c, m),
            "Daly (2006): sqrt(2CM)(1 + sqrt(C/2M)/3 + C/(18M)) - C; it matters once C is not "
            "small against M.")


# -- choice: settled by a measurement in the chapter -------------------------------------------

CHOICES = [
    Choice("local-steps-then-average", TOPIC,
           "Replicas take H local AdamW steps, then average their parameters (DiLoCo's outer "
           "step at lr 1, no momentum). Does it train?",
           ("Yes: the loss falls steadily, behind DDP's at equal tokens; it is not DDP (it "
            "differs once H > 1), but it trains", "No: averaging parameters after local Adam "
            "steps diverges", "It is exactly DDP for any H"), 0,
           "Measured on 4 replicas over 200 steps: local SGD at H = 50 trains steadily with 50 "
           "times fewer syncs, ending behind DDP. It only equals DDP at H = 1.", DILOCO),
    Choice("diloco-h1-is-ddp", TOPIC,
           "What is DiLoCo with H = 1, inner SGD, and outer SGD at lr 1 without momentum?",
           ("data parallelism: the same step, up to rounding", "worse than DDP by a factor "
            "of 2 in bytes", "local SGD with H = 2"), 0,
           "theta - mean(theta - (theta - lr g_i)) = theta - lr mean(g_i); engine.ft.diloco's test "
           "holds it within 1e-6.", DILOCO),
    Choice("diloco-outer-nesterov", TOPIC,
           "In DiLoCo, what is the outer optimizer and what is its gradient?",
           ("SGD with Nesterov momentum; its gradient is the mean over replicas of start minus "
            "end parameters", "AdamW on the averaged parameters", "Plain averaging; no outer "
            "optimizer"), 0,
           "Douillard et al., 2023, Algorithm 1: outer lr 0.7, momentum 0.9, Nesterov, on the "
           "pseudo-gradient.", DILOCO),
    Choice("streaming-total", TOPIC,
           "Streaming DiLoCo with F fragments against DiLoCo at the same H: the bytes?",
           ("The same total; the peak per sync is F times smaller", "F times fewer bytes in "
            "total", "F times more bytes, for the overlap"), 0,
           "Counted: each fragment still syncs every H steps; only 1/F of the model crosses "
           "the link at once.", STREAMING),
    Choice("hsdp-slow-link", TOPIC,
           "HSDP across two sites (ZeRO-3 inside each, replicas across): what crosses the slow "
           "link each step?",
           ("One all-reduce of each rank's 1/S gradient shard: 1/S of what DDP sends there",
            "Every parameter all-gather of ZeRO-3, as in FSDP over all ranks",
            "The whole gradient, as in DDP"), 0,
           "Counted: the replica dimension carries 2(R-1)/R x P/S per rank; the all-gathers stay "
           "inside the site. FSDP over every rank would put them on the slow link too.", HSDP),
    Choice("ft-survivors", TOPIC,
           "Per-step fault tolerance: a replica group is killed mid-step, after computing its "
           "gradient and just before the gradient all-reduce. What do the other groups do?",
           ("Abort that round and redo the step without it, no restart; the next quorum leaves "
            "it out", "All restart from the last checkpoint", "Wait until it comes back"), 0,
           "Measured (group 2 SIGKILLed at step 3, just before the all-reduce): the survivors' "
           "round fails, they redo the step without it (a little over the quorum deadline "
           "lost) and every later step too, until it rejoins.", FT),
    Choice("ft-rejoin", TOPIC,
           "The killed replica group restarts. Where does it get its parameters and optimizer "
           "state?",
           ("From a live peer's memory, bit-identical to the survivors'", "From the last "
            "checkpoint on disk, then it replays the missed steps", "It starts from fresh "
            "weights and catches up"), 0,
           "Measured: the state digest after loading equals the sender's, and the run ends "
           "equal to the reference recomputed from each step's quorum.", FT),
    Choice("checkpoint-more-often", TOPIC,
           "Is checkpointing as often as you can always safer?",
           ("No: past Young's interval the checkpoints' own cost dominates and the wall time "
            "grows", "Yes, it can only shorten the run", "It makes no difference"), 0,
           "Simulated with exponential failures: the wall time is least near sqrt(2CM) and "
           "rises on both sides.", INTERVAL),
    Choice("straggler-median", TOPIC,
           "A straggler detector divides each rank's step time by ... and names a rank after "
           "several slow steps in a row. Divided by what, and why in a row?",
           ("The median over ranks (one slow rank cannot move it); in a row to ignore one-off "
            "spikes", "The mean (the slow rank raises it, hiding itself); one step suffices",
            "The fastest rank's time; one step suffices"), 0,
           "Measured: a rank slowed 2x is named within a few steps; none is named in 500 "
           "healthy steps with jitter and spikes.", STRAGGLER),
]

OUTLINES = [
    Outline("slow-links-answer", TOPIC, "How do you train across data centres with slow links?",
            ("inside a site: FSDP/ZeRO on the fast links; across sites: replicate (HSDP), so "
             "only 1/S of the gradient crosses",
             "DiLoCo: H local steps, then all-reduce the pseudo-gradient, outer Nesterov: H x "
             "fewer bytes",
             "streaming DiLoCo: fragments at staggered steps, overlapped, peak / F; bf16 or "
             "lower on the wire",
             "not DDP for H > 1: on the tiny GPT every DiLoCo run ends far below the untrained "
             "loss, behind DDP at equal tokens on a short run",
             "the outer lr is tuned per H: the paper's 0.7 with momentum 0.9 overshoots when H "
             "inner steps travel most of the way (the MLP at H = 100 ends worse than untrained)"),
            evidence=ANSWER),
    Outline("gpu-dies-answer", TOPIC,
            "What happens when a GPU dies at step 40 000 of a 10 000-GPU run?",
            ("classic: the job stops, every rank restarts from the last checkpoint; the work "
             "since then is lost",
             "checkpoint about every sqrt(2 C MTBF), written asynchronously (snapshot to host, "
             "write in the background)",
             "per-step fault tolerance: the replica group is left out of the next quorum; the "
             "others continue",
             "it rejoins by copying the state from a live peer, no disk"),
            evidence=ANSWER),
    Outline("straggler-answer", TOPIC, "How do you find a straggler?",
            ("gather every rank's step time each step (one small all-gather)",
             "divide by the median across ranks; the slow rank stands out, the median does not "
             "move",
             "name it after k slow steps in a row, ignoring one-off spikes",
             "then drain or replace the node; keep the false-positive rate near zero"),
            evidence=STRAGGLER),
]

ITEMS: list = [  # Numeric, Choice and Outline items of topic 'slow links and failures'
    Numeric("diloco-bytes-saving", TOPIC, _diloco_saving, unit="x"),
    Numeric("diloco-sync-gb", TOPIC, _diloco_sync_gb, unit="GB"),
    Numeric("streaming-peak-gb", TOPIC, _streaming_peak_gb, unit="GB"),
    Numeric("diloco-syncs", TOPIC, _diloco_syncs, unit="syncs"),
    Numeric("hsdp-replica-bytes", TOPIC, _hsdp_mb, unit="MB"),
    Numeric("hsdp-cut", TOPIC, _hsdp_cut, unit="x"),
    Numeric("ft-cross-bytes", TOPIC, _ft_cross_mb, unit="MB"),
    Numeric("young-interval", TOPIC, _young_multiple, unit="x"),
    Numeric("young-waste", TOPIC, _young_waste, unit="%"),
    Numeric("checkpoint-too-often", TOPIC, _waste_too_often, unit="x"),
    Numeric("daly-over-young", TOPIC, _daly_over_young, unit="fraction"),
    *CHOICES,
    *OUTLINES,
]
