"""Misconception items: a claim from two widely shared model interview answers, or a common
one, the options, and the chapter section whose measurement settles it."""

from __future__ import annotations

from engine.drill.items import Choice

C01, C02, C03 = "course/01_collectives.ipynb", "course/02_data_parallel.ipynb", \
    "course/03_compression.ipynb"
C04, C05, C06, C07 = "course/04_zero.ipynb", "course/05_tensor_parallel.ipynb", \
    "course/06_pipeline.ipynb", "course/07_3d_parallelism.ipynb"
C09, C10 = "course/09_long_context.ipynb", "course/10_moe.ipynb"

CHOICE = [
    # -- common claims that are wrong or imprecise ---------------------------------------------
    Choice("ps-vs-ring-total", "collectives",
           "A parameter server 'moves 2(N-1)M, a ring 2(N-1)M/N'. What is the ring's real "
           "advantage?",
           ("No link carries more than 2(N-1)/N x M: the traffic is spread evenly",
            "The ring moves N times fewer bytes in total",
            "The ring needs no reduction arithmetic"), 0,
           "Summed over all ranks both move about 2(N-1)M; the server's link carries (N-1)M "
           "each way, the bottleneck.", (C01, "Parameter server against ring")),
    Choice("ring-independent-of-n", "collectives",
           "'Ring all-reduce time is independent of the number of GPUs.' Is that true?",
           ("Only the bandwidth term is; the latency term 2(N-1) alpha grows with N",
            "Yes, completely", "No: its bandwidth term grows linearly with N"), 0,
           "Small messages are latency-bound: a tree (2 log N rounds) wins there.",
           (C01, "Latency against bandwidth: when a tree wins")),
    Choice("nvlink-tree", "collectives",
           "'Tree all-reduce, like NVIDIA's NVLink.' What is NVLink?",
           ("An interconnect; NCCL's tree (double binary tree) is an algorithm",
            "NCCL's tree algorithm", "A reduction operator in the GPU"), 0,
           "Algorithms (ring, tree) run over interconnects (NVLink, InfiniBand).",
           (C01, "NCCL on GPUs: ring, tree, and the knobs (GPU lab)")),
    Choice("zero1-more-comm", "zero",
           "Does ZeRO-1 increase communication over plain data parallelism?",
           ("No: reduce-scatter + all-gather move what one all-reduce moves, 2 psi",
            "Yes, by 1.5x", "Yes, it doubles"), 0,
           "Measured: 1.5 psi per rank at N = 4 for stages 0, 1 and 2 alike.",
           (C04, "Communication: 2Ψ, and 3Ψ for stage 3")),
    Choice("zero3-doubles", "zero",
           "'ZeRO-3 doubles communication.' With one micro-batch per step, how much more does "
           "it send than ZeRO-2?",
           ("1.5x: parameters gathered twice plus one reduce-scatter, 3 psi vs 2 psi",
            "2x", "The same"), 0, "Measured 2.25 psi vs 1.5 psi at N = 4. With k micro-batches "
           "of accumulation ZeRO-3 gathers again for each: 3k(N-1)/N psi.",
           (C04, "Communication: 2Ψ, and 3Ψ for stage 3"),
           zh="ZeRO-2 和 ZeRO-3 在通信上的具体差异是什么？"),
    Choice("zero-4-8-16", "zero",
           "'ZeRO-1 saves 4x, ZeRO-2 8x, ZeRO-3 16x.' What do they save on 4 GPUs with "
           "mixed-precision Adam?",
           ("2.29x, 2.91x and 4x", "4x, 8x and 16x", "1.33x, 2x and 4x"), 0,
           "4x and 8x are limits as N grows; ZeRO-3 saves N x.",
           (C04, "The stages, built one by one, measured")),
    Choice("zero2-allgather-grads", "zero",
           "In ZeRO-2, what is all-gathered after the optimizer step?",
           ("The updated parameters", "The full gradients", "The optimizer states"), 0,
           "Each rank only needs the averaged gradient of its own slice.",
           (C04, "Communication: 2Ψ, and 3Ψ for stage 3")),
    Choice("dp-comm-linear", "data parallel",
           "'Data-parallel communication grows linearly with the number of GPUs.' How does what "
           "each GPU sends grow?",
           ("About constant: 2(N-1)/N x M tends to 2M", "Linear in N", "Logarithmic in N"), 0,
           "Per GPU it is nearly flat; what grows is the latency term and stragglers.",
           (C02, 'Misconception (b): "the speed-up is linear"')),
    Choice("tp-one-allreduce", "tensor parallel",
           "'Tensor parallelism needs one all-reduce per layer.' How many does Megatron need per "
           "layer?",
           ("2 forward and 2 backward (attention and MLP)", "1 forward, 1 backward",
            "1 per layer in total"), 0, "Counted by the meter: 2 + 2 per layer.",
           (C05, "Attention by heads, and the whole tiny GPT")),
    Choice("tp-across-nodes", "tensor parallel",
           "Where does tensor parallelism belong?",
           ("Inside a node, on NVLink; DP and PP across nodes", "Across nodes, DP inside",
            "Anywhere: its traffic is small"), 0,
           "Four blocking all-reduces of b*s*h per transformer layer per micro-batch.",
           (C05, "Why tensor parallelism stays inside a node")),
    Choice("gpt3-layer-size", "tensor parallel",
           "'GPT-3: 96 layers, about 1.8 GB per layer.' What is 1.8?",
           ("Billions of parameters per layer (12 h^2); 3.6 GB in fp16", "GB in fp16",
            "GB in fp32"), 0, "12 x 12288^2 = 1.81 B.",
           (C05, "Why tensor parallelism stays inside a node")),
    Choice("gpt3-350gb", "3d and scale",
           "'Pure data parallelism needs 350 GB per GPU for GPT-3.' What does it really need?",
           ("About 2.8 TB: 16 bytes per parameter of model states",
            "350 GB, the fp16 weights", "700 GB, weights and gradients"), 0,
           "350 GB is only the fp16 weights.", (C04, "The stages, built one by one, measured")),
    Choice("bubble-p-minus-1-over-m", "pipeline",
           "'The bubble is (p-1)/m.' Relative to what?",
           ("The ideal (busy) time; relative to the total it is (p-1)/(m+p-1)",
            "The total time", "One micro-batch"), 0, "Two definitions; say which.",
           (C06, "The bubble, and its two definitions")),
    Choice("1f1b-less-bubble", "pipeline",
           "What does 1F1B improve over GPipe?",
           ("Activation memory: at most p micro-batches in flight; the bubble is the same",
            "The bubble", "Both bubble and memory"), 0,
           "Simulated and measured: same bubble, bounded activations.",
           (C06, "1F1B: the same bubble, bounded memory")),
    Choice("m-10p", "pipeline",
           "'m >= 10p keeps the bubble under 10%.' What is needed (relative to ideal time)?",
           ("m > 10(p-1)", "m >= 10p exactly", "m > p"), 0, "(p-1)/m < 0.1.",
           (C06, "Choosing p and m"), zh="流水线并行中，如何选择stage数量和微批次大小？"),
    Choice("dp-microbatches", "data parallel",
           "What does data parallelism split?",
           ("The global batch, into one shard per rank", "The batch into micro-batches",
            "The model's layers"), 0, "Micro-batches belong to accumulation and pipelines.",
           (C02, "What is split, and what is not")),
    Choice("topk-1-percent", "compression",
           "Top-K at 1% with fp32 values: what share of a dense gradient's bytes does a rank "
           "send?", ("2% (values + int32 indices), and gathering grows with N",
                     "1%", "0.5%"), 0,
           "With int32 indices beside fp32 values the indices cost as much as the values; "
           "torch.topk's int64 indices cost twice that, and a compact encoding (sorted gaps as "
           "varints) far less.",
           (C03, "Sparsification: Top-K, and why it needs error feedback")),
    Choice("accumulation-memory", "data parallel",
           "'Gradient accumulation reduces communication but increases memory.' What does it "
           "really cost in memory?",
           ("It adds no gradient memory, and keeps one micro-batch of activations",
            "It doubles gradient memory", "It needs k copies of the gradients"), 0,
           "Measured: same gradient bytes; activations of one micro-batch. Its cost is time: "
           "the k micro-batches run in sequence for each update.",
           (C02, "Gradient accumulation: fewer all-reduces, no extra gradient memory, and $k$ "
                 "times the time per update")),
    # -- the documents' common wrong answers ---------------------------------------------------
    Choice("param-averaging", "data parallel",
           "'Each GPU trains on different data and the parameters are averaged at the end.' Is "
           "that data parallelism?",
           ("Not DDP: DDP averages gradients every step; averaging parameters after local "
            "steps is local SGD (or DiLoCo), which trains but differs from DDP once the replicas "
            "take more than one step between averages", "Right: it is DDP for any optimizer",
            "Right for Adam only"), 0,
           "Measured on 4 ranks with Adam: parameter averaging drifts away from DDP's "
           "parameters. It does not diverge: chapter 11 measures local SGD and DiLoCo still "
           "training, behind DDP at equal tokens, with H times fewer syncs.",
           (C02, 'Misconception (a): "data parallelism just averages the parameters"'),
           zh="什么是数据并行"),
    Choice("linear-speedup", "data parallel",
           "'Data parallelism scales linearly with the number of GPUs.' Does it, as N grows?",
           ("No: communication and latency make efficiency fall as N grows",
            "Yes, with ring all-reduce", "Yes, with overlap"), 0,
           "Chapter 02 measures the efficiency at N = 2 and 4 on your machine; alpha-beta + "
           "Amdahl predicts the rest.",
           (C02, 'Misconception (b): "the speed-up is linear"')),
    Choice("async-always-faster", "data parallel",
           "'Asynchronous updates avoid waiting, so they are always better.' Are they always "
           "better?",
           ("No: stale gradients hurt per update; bounded staleness trades waiting for "
            "freshness", "Yes, always", "Yes, except for Adam"), 0,
           "Measured loss against staleness, and a straggler with SSP.",
           (C02, 'Misconception (c): "asynchronous is always faster"')),
    Choice("dp-vs-mp", "3d and scale",
           "Data parallelism vs model parallelism: what is replicated and what is split?",
           ("DP replicates the model and splits the data; MP splits the model",
            "Both split the model", "DP splits the model, MP the data"), 0,
           "And DP is bounded by memory, MP by interconnect bandwidth.",
           (C07, "Which parallelism, when"),
           zh="大模型训练中的数据并行、模型并行、流水线并行分别适用于什么场景?ZeRO 是什么"),
    Choice("zero-always", "zero",
           "'ZeRO is a memory optimization: just turn it on.' What can it cost?",
           ("Stage 3 costs 1.5x traffic and can be slower on a slow network",
            "Right: it is free", "It only works with pipelines"), 0,
           "ZeRO improves data parallelism; its stages differ in traffic.",
           (C04, "Communication: 2Ψ, and 3Ψ for stage 3")),
    Choice("pp-no-downside", "pipeline",
           "'Pipeline parallelism just splits the layers, no downside.' What is its downside?",
           ("It has a bubble of (p-1)/(m+p-1) and runs at its slowest stage's pace",
            "Right", "Its only cost is memory"), 0,
           "Chapter 06 measures the bubble, and a balanced partition running faster than a "
           "uniform one.", (C06, "Stage balance")),
    # -- more traps --------------------------------------------------------------------------
    Choice("ef-optional", "compression",
           "Top-K at 0.1% without error feedback, for the same number of steps: what do you "
           "expect against Top-K with it?",
           ("Clearly worse: the dropped coordinates are lost for good",
            "The same as with error feedback", "Better: less noise"), 0,
           "Chapter 03's experiment prints both accuracies: without error feedback it ends "
           "clearly lower.",
           (C03, "The convergence experiment")),
    Choice("fp16-underflow", "compression",
           "Gradients of order 1e-7 are sent in fp16, or in bf16: what happens to them?",
           ("fp16 keeps them as subnormals with only a few bits, and rounds the smallest to "
            "zero; bf16 keeps them (8-bit exponent)",
            "Both round them to zero", "Neither loses anything: 16 bits are enough"), 0,
           "fp16's smallest normal is 2^-14 (6.1e-5) and its smallest subnormal 2^-24 (6.0e-8): "
           "1e-7 keeps about one significant bit, and below 2^-25 a value rounds to 0. bf16 "
           "has fp32's exponent. Chapter 03 prints the share of zeros.",
           (C03, "Quantization: send 16 bits instead of 32")),
    Choice("zero3-vs-tp-traffic", "tensor parallel",
           "ZeRO-3 vs tensor parallelism: what does each send?",
           ("ZeRO-3: parameters (batch-independent); TP: activations (grow with b*s)",
            "Both send parameters", "Both send activations"), 0,
           "Measured per layer, with the crossover near 4.5h tokens.",
           (C05, "Tensor parallelism or ZeRO-3?"),
           zh="ZeRO-3和模型并行有什么区别？什么时候用ZeRO-3，什么时候用张量并行？"),
    Choice("interleave-free", "pipeline",
           "Interleaving with v chunks per GPU costs what?",
           ("v times more point-to-point messages (and m a multiple of p)", "Nothing",
            "v times more memory for parameters"), 0, "It divides the bubble by v.",
           (C06, "Interleaving: a smaller bubble for more messages")),
    Choice("zero-bubble-free", "pipeline",
           "A common answer: 'zero-bubble schedules remove the bubble at no cost.' On a model "
           "of transformer layers, what do they pay?",
           ("It depends on the schedule: ZB-H1 and ZB-V keep 1F1B's peak activations (p "
            "micro-batches); ZB-V and DualPipeV send twice the point-to-point messages; ZB-H2 "
            "pays memory (2p-1 micro-batches); all run two smaller passes instead of one "
            "backward",
            "Memory, every one of them: each micro-batch keeps its layers' inputs and output "
            "gradients from B to W, on top of 1F1B's activations",
            "Nothing: the weight gradient had to be computed anyway"), 0,
           "Measured on transformer blocks: the W-stash is smaller than the activations B "
           "frees, so ZB-H1 and ZB-V peak at 1F1B's p micro-batches (on a stack of MLP blocks "
           "the stash outweighs them, and there every split schedule holds more).",
           (C06, "The memory table: what each schedule holds and sends")),
    Choice("zb-two-formulas", "pipeline",
           "ZB-H1's bubble: (p-1)(F+B-W) in the paper, (PP-1)(F+B-2W) in the DualPipe README. "
           "Which is right?",
           ("Both: the README's B is the full backward (input + weight gradient), the paper's "
            "the input gradient alone", "The paper's; the README has a typo",
            "The README's; the paper forgets W"), 0,
           "Substitute B_full = B + W.", (C06, "Two published formulas, one bubble")),
    Choice("zbv-placement", "pipeline",
           "ZB-V and DualPipeV on p GPUs, two chunks each: which virtual stages does GPU 0 hold?",
           ("0 and 2p-1: the chunks go down the GPUs and come back up, a V",
            "0 and p, as in interleaved 1F1B", "0 and 1"), 0,
           "The bottom of the V stays on GPU p-1, no message.",
           (C06, "ZB-V and DualPipeV: two chunks per GPU, placed in a V")),
    # -- mixture of experts (chapter 10) -------------------------------------------------------
    Choice("moe-experts-need-tp", "moe",
           "A common answer: 'MoE expert layers are so large that they must use tensor "
           "parallelism.' How are experts actually split?",
           ("Expert parallelism: whole experts on different GPUs; one expert is an ordinary MLP",
            "Tensor parallelism inside every expert, always",
            "Pipeline parallelism over the experts"), 0,
           "What grows is the number of experts, and EP splits exactly that; a Mixtral expert is "
           "0.35 GB in bf16. TP stays an option, not a requirement.",
           (C10, "EP in a mesh with DP and TP: which group reduces which gradient")),
    Choice("moe-expert-gradients", "moe",
           "EP x DP: over which ranks are an expert's gradients reduced?",
           ("Summed over the dp ranks holding the same expert, divided by dp x ep",
            "Averaged over its expert-parallel group", "Averaged over every rank, like dense "
            "weights"), 0,
           "The all-to-all already brought back the gradients of the whole EP group's tokens; "
           "only the expert's replicas are missing. Dividing by dp only is ep times too large.",
           (C10, "EP in a mesh with DP and TP: which group reduces which gradient")),
    Choice("moe-dropped-token", "moe",
           "Switch-style routing: what happens to a token whose expert is over capacity?",
           ("That expert contributes nothing; with every choice dropped the residual carries "
            "the token through", "It waits for the next batch",
            "It goes to the next expert with room"), 0,
           "Drops are decided in a fixed priority order: first choices, then second choices.",
           (C10, "Capacity and dropped tokens")),
    Choice("moe-flops", "moe",
           "Mixtral-8x7B (47B parameters, top-2 of 8) against a dense 47B model: FLOPs per "
           "token?",
           ("About a 13B model's: only 2 of each layer's 8 experts run",
            "The same as the dense 47B", "One eighth of the dense 47B"), 0,
           "Memory follows the total parameters, FLOPs the active ones.",
           (C10, "Dense vs sparse: parameters and FLOPs per token")),
    Choice("moe-balancing-gradient", "moe",
           "In Switch's balancing loss alpha E sum_i f_i P_i, with f_i counted from the top-k "
           "choices as Switch defines it, which factor carries the gradient?",
           ("P_i, the mean router probability: f_i counts discrete choices",
            "f_i, the fraction routed", "Both"), 0,
           "d loss / d probs[t, i] = alpha E f_i / T pushes probability away from busy experts. "
           "The loss is alpha when f and P are both uniform, but that is not its minimum: it is "
           "a heuristic (two experts, three tokens: 0.893 alpha).",
           (C10, "The load-balancing loss at work")),
    Choice("moe-ep-inside-node", "moe",
           "Why keep an expert-parallel group inside a node?",
           ("Its all-to-alls are on the critical path, four per layer per micro-batch, and a "
            "GPU's network link has about 9x less bandwidth than its NVLink",
            "Experts cannot be copied across nodes",
            "All-to-all is impossible over InfiniBand"), 0,
           "engine.theory.hardware, per GPU and direction: H100 NVLink 450 GB/s against one 400G "
           "InfiniBand NIC, 50 GB/s (9x; an A100 with HDR 200G: 300 against 25, 12x). The "
           "planner: the same layout's all-to-all time grows that much when the group crosses "
           "nodes.",
           (C10, "Why all-to-all across nodes hurts")),
    Choice("ring-attention-bytes-fall", "long context",
           "'Ring attention: the more GPUs, the less each one sends.' What does each GPU send "
           "per layer as N grows?",
           ("About constant: each GPU must see every K/V block once, ~2 S kv forward",
            "It falls as 1/N", "It grows as N"), 0,
           "Counted: 2(N-1)(S/N) kv per rank forward; what falls with N is memory and compute.",
           (C09, "Ring attention, step by step")),
    Choice("sp-saves-communication", "long context",
           "What does Megatron sequence parallelism do to tensor parallelism's communication?",
           ("Each all-reduce becomes a reduce-scatter plus an all-gather: same bytes forward; "
            "backward adds a re-gather of each column layer's input",
            "It halves it", "It removes the all-reduces"), 0,
           "It buys activation memory (10sbh becomes 10sbh/t), not bandwidth.",
           (C09, "Megatron sequence parallelism")),
    Choice("ring-attention-approximate", "long context",
           "Is ring attention an approximation of full attention?",
           ("No: the online-softmax merge makes it exact (equal to dense attention to fp32 "
            "round-off)", "Yes: each GPU sees only nearby tokens",
            "Yes: softmax is renormalised per block"), 0,
           "Each block's output and log-sum-exp merge exactly; gradients too.",
           (C09, "The online-softmax merge")),
    Choice("causal-contiguous-balance", "long context",
           "Causal ring attention with the sequence split into contiguous chunks: how is the work "
           "spread over the GPUs?",
           ("The last GPU does nearly twice the average (2N/(N+1) counting diagonal blocks "
            "whole, 2 - 1/N when the kernel skips their masked half); zig-zag evens it out",
            "Even: every GPU holds S/N tokens", "The first GPU is the busiest"), 0,
           "Rank r computes r full blocks and one diagonal block. Zig-zag gives each rank 2N+1 "
           "blocks of side S/2N (half the side, a quarter of the area) counted whole, or 2N "
           "with the diagonals' masked halves skipped.",
           (C09, "The causal imbalance, and zig-zag")),
    Choice("ulysses-any-degree", "long context",
           "Ulysses on a model with 32 query heads and 8 KV heads: can it run over 16 GPUs?",
           ("Yes: N must divide the 32 query heads; each KV head is replicated to the 2 GPUs "
            "whose query heads read it (16 KV heads travel, more bytes)",
            "No: N must divide the 8 KV heads, so use ring attention",
            "Yes, by splitting each KV head's 128 dimensions in half"), 0,
           "A rank needs whole query heads and the KV head of each; past the KV heads the KV "
           "heads are replicated (lcm(8, 16) = 16 travel). DeepSpeed also added uneven head "
           "splits for N not dividing the heads.",
           (C09, "Ulysses past the KV heads")),
    # -- more misconceptions -------------------------------------------------------------------
    Choice("zero-redundancy-optimizer", "zero",
           "A common answer calls PyTorch's ZeroRedundancyOptimizer ZeRO-1. Next to ZeRO-1's "
           "2(N-1)/N psi, what does each GPU send per step with it behind DDP?",
           ("About 3(N-1)/N psi: DDP all-reduces the full gradients, then every GPU broadcasts its "
            "updated part", "The same 2(N-1)/N psi: sharding the optimizer is all ZeRO-1 does",
            "Less: only the optimizer shards travel"), 0,
           "It shards Adam's moments as ZeRO-1 does, so memory matches; ZeRO-1 proper "
           "reduce-scatters the gradients instead of all-reducing them, 1.5x fewer bytes.",
           (C04, "PyTorch's `ZeroRedundancyOptimizer` is not ZeRO-1 on the wire")),
    Choice("zero-shards-activations", "zero",
           "ZeRO-3 on 64 GPUs: what happens to the activation memory of each GPU?",
           ("Nothing: ZeRO shards model states only; activations grow with micro-batch and "
            "sequence, and shrink with checkpointing or with tensor, sequence or context "
            "parallelism", "It is divided by 64, like the parameters",
            "It moves to the CPU with the optimizer states"), 0,
           "Activation checkpointing keeps each block's input and recomputes the rest during "
           "backward: one more forward for a large cut.",
           (C04, "Activations: the memory ZeRO does not shard")),
    Choice("tp-mlp-column-first", "tensor parallel",
           "Why does Megatron split the MLP's first weight by columns and its second by rows?",
           ("GeLU is elementwise, so each GPU applies it to its own columns, which are exactly "
            "the slice the row-split second weight needs: one all-reduce, at the end",
            "A column split needs less memory than a row split",
            "Rows first would need no communication at all"), 0,
           "Rows first would leave each GPU a partial sum, and GeLU of a sum is not the sum of "
           "GeLUs: an all-reduce before GeLU as well as after.",
           (C05, "Why the MLP goes column-first")),
    Choice("tp-gather-logits", "tensor parallel",
           "The output layer is split by vocabulary over t GPUs. Why not all-gather the logits "
           "and compute the cross-entropy as usual?",
           ("Every token would move its V logits; the vocabulary-parallel loss all-reduces three "
            "numbers per token (max, sum of exponentials, target logit)",
            "It would be fine: logits are small", "Softmax cannot be computed on gathered logits"),
           0, "Three numbers per token instead of 50,257 for GPT-2's vocabulary, and no GPU ever "
           "holds the full logits.", (C05, "The vocabulary-parallel loss")),
    Choice("hfu-vs-mfu", "3d and scale",
           "Megatron-LM trains GPT-3 with full activation recomputation at 140 TFLOP/s per A100. "
           "Is that its model FLOPs utilisation?",
           ("No: it counts the recomputed forward too (hardware FLOPs); the model's own FLOPs "
            "are 3/4 of it", "Yes: every FLOP the GPU runs is the model's",
            "No: it is the A100's peak rate"), 0,
           "With recomputation a step costs 96 B s l h^2(...) instead of 72: MFU counts the 72, so "
           "runs with and without recomputation compare fairly.",
           (C07, "GPT-3 175B, by the numbers")),
    Choice("failures-at-scale", "3d and scale",
           "A job moves to 16 times more GPUs of the same kind. What happens to its mean time "
           "between failures?",
           ("It falls 16x: failures per day grow with the GPU count, so frequent checkpoints and "
            "automatic restarts become routine", "It stays the same: each GPU is as reliable",
            "It grows: more GPUs add redundancy"), 0,
           "The failure rate per GPU-day is fixed; Young's interval sqrt(2 C M) shrinks with the "
           "MTBF M.", (C07, "What changes on 1000 GPUs")),
    Choice("moe-all-to-all-with-n", "moe",
           "Expert parallelism with T tokens per GPU: the group grows from 8 to 64 GPUs. What "
           "happens to the bytes each GPU sends per all-to-all?",
           ("Almost nothing: (n-1)/n x T k h values, 7/8 then 63/64 of T k h",
            "They fall as 1/n: each GPU holds fewer experts", "They grow linearly with n"), 0,
           "Each (token, expert) row bound for another GPU crosses the wire once; what changes "
           "with n is which links the group spans.",
           (C10, "Dispatch and combine: two all-to-alls")),
    Choice("moe-ep-changes-math", "moe",
           "Does expert parallelism over n GPUs compute something different from one process "
           "running the same MoE layer once on each GPU's tokens?",
           ("No: each GPU routes its own tokens, so capacity, drops, outputs, losses and "
            "gradients are the same", "Yes: tokens compete for capacity across all GPUs",
            "Yes: a GPU only sees the outputs of its own experts"), 0,
           "Chapter 10 checks it on 4 ranks, with no drops and with a third of the assignments "
           "dropped.", (C10, "Expert parallelism equals one process")),
    Choice("ring-vs-ulysses-scaling", "long context",
           "Sequence fixed, GPUs N growing: how does each GPU's traffic per layer change under "
           "ring attention and under Ulysses?",
           ("Ulysses' falls about as 1/N; the ring's stays near 2 S kv whatever N",
            "Both fall as 1/N", "Both stay constant"), 0,
           "Ulysses' all-to-alls send (N-1)/N^2 x S (2h + 2kv); the ring passes every K/V block "
           "once around. Ulysses' hard limit is N = the number of query heads (KV heads are "
           "replicated past their count).",
           (C09, "Ring or Ulysses: when each wins")),
]
