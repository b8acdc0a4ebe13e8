"""The sections of a run's configuration: every setting, its type and its default.

`partita.config.Config` holds one of each and reads them from TOML and the command line;
the comments beside each field are what `partita train --help` and the docs say of it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelSection:
    name: str = "tiny"  # catalog entry; the fields below override its shape when set
    vocab_size: int | None = None
    # Pad the embedding and head to a multiple of this (see models.model_config).
    vocab_multiple: int | None = None
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_dim: int | None = None
    max_seq_len: int | None = None
    flavour: str | None = None
    tie_embeddings: bool | None = None
    qkv_bias: bool | None = None  # biases on q, k and v of a llama model (Qwen2)
    # Sliding-window attention of N positions (Mistral's; see models.model_config).
    attention_window: int | None = None
    dropout: float | None = None
    seed: int | None = None
    # Attention kernel: "auto", "sdpa" or "explicit" (see models.attention_kernel).
    attention: str | None = None
    rope_theta: float | None = None
    norm_eps: float | None = None
    rope_scaling: str | None = None  # "" none, "llama3" (see models.model_config)
    rope_factor: float | None = None
    rope_low_freq_factor: float | None = None
    rope_high_freq_factor: float | None = None
    rope_original_max_len: int | None = None
    # Mixture of experts (see partita.models.model_config); None keeps the catalog's.
    n_experts: int | None = None
    top_k: int | None = None
    moe_every: int | None = None
    expert_ffn_dim: int | None = None
    capacity_factor: float | None = None  # unset: dropless
    router_gating: str | None = None
    router_norm_topk: bool | None = None
    shared_experts: int | None = None
    aux_loss_weight: float | None = None
    z_loss_weight: float | None = None
    # A Hugging Face Llama folder (config.json + safetensors): its shape replaces the
    # catalog entry and its weights the random init, read slice by slice on every rank.
    init_from: str = ""


@dataclass
class DataSection:
    source: str = ""  # "" = the built-in corpus (Python's standard library sources)
    cache_dir: str = ""  # "" = default_cache_dir(): ~/.cache/partita
    seq_len: int = 128
    val_fraction: float = 0.01
    max_bytes: int = 4_000_000  # budget of the built-in corpus
    seed: int = 0
    # A tokenizer.json, or a Hugging Face model folder holding one; "" = bytes (vocab 256).
    tokenizer: str = ""
    text_field: str = "text"  # JSONL / Parquet / saved-dataset sources: the text field
    # A bad record (a JSONL line not UTF-8 or not JSON, a null Parquet text): "error",
    # or "skip" (counted).
    bad_lines: str = "error"
    # Tokenizer processes when preparing the cache; 0 or 1: this process, whose batch
    # encoding already runs on every core (the tokenizers library's own threads).
    workers: int = 0
    # Several sources by weight: "a.jsonl=0.7, b/=0.3" or a TOML table; replaces source.
    mix: str = ""
    # Packed documents (a tokenizer with an end-of-document token): attend only within
    # one's own document (true), or across the whole packed row as plain causal (false).
    document_mask: bool = True


@dataclass
class TrainSection:
    steps: int = 300
    global_batch: int = 16  # sequences per optimizer step, over all replicas
    microbatches: int = 1  # gradient accumulation (and pipeline microbatches)
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 = no clipping (the norm is still logged)
    eval_every: int = 100
    eval_batches: int = 4
    log_every: int = 10
    out_dir: str = "runs/default"
    overwrite: bool = False  # replace another run's results found in out_dir
    dtype: str = "float32"  # parameter dtype when precision.param_dtype is unset
    # auto: cuda when available, else cpu; cuda: local rank r on GPU r; cuda:N: GPU N for
    # the one process of each node (NCCL runs one process per GPU).
    device: str = "auto"
    max_bad_steps: int = 0  # NaN/inf losses tolerated before stopping (0: stop at once)
    progress: bool = True  # a progress bar when the output is a terminal
    # On CPU, refuse before launch a job the planner predicts needs more memory than the
    # machine has available (partita.commands.memory_check); false starts it anyway.
    host_memory_check: bool = True
    threads: int = 0  # intra-op threads per rank; 0 = the cores shared among local ranks
    # A collective that does not complete within this many seconds fails the run (a dead
    # or stalled rank) instead of hanging it; so does a process left after the others
    # finished that stays stopped, or does nothing (hung), this long.
    collective_timeout_s: float = 600.0
    # Warn (rank 0, once per stall) when a step runs this many times the median step time
    # (an evaluation or a checkpoint write: its own median), naming the ranks that are
    # behind; 0 turns the watchdog off.
    stall_warning_factor: float = 20.0
    timeline_png: str = ""  # pipeline runs: draw the last step's measured timeline here
    # Checkpoints (docs/checkpoints.md). Every N steps (0: only when stopped by SIGTERM
    # or train.stop_after, and at the end of a run that checkpoints), into
    # checkpoint_dir ("" = OUT_DIR/checkpoints), keeping the newest keep_last (0: all).
    checkpoint_every: int = 0
    checkpoint_dir: str = ""
    keep_last: int = 3
    # "": a fresh run; "auto": the newest complete checkpoint in checkpoint_dir, or a
    # fresh run when there is none; or the path of a checkpoint (or of a run's out_dir).
    resume: str = ""
    stop_after: int = 0  # stop after this step with a checkpoint (0: run to the end)
    async_checkpoint: bool = True  # write on a background thread; training waits only for a copy
    # A save that fails (a full disk): "stop" the run, or "continue" training and try
    # again at the next checkpoint. The previous checkpoint is kept either way.
    checkpoint_failure: str = "stop"
    export: str = ""  # "hf": also write out_dir/hf, a Hugging Face folder (partita export)
    # torch.compile: "none"; "blocks" each transformer block; "model" the whole local model
    # (layouts without pipeline, ZeRO-3 or cp; with recompute, except full recompute under
    # tp or with MoE blocks; its one compiled backward leaves data-parallel communication
    # unoverlapped); "auto" blocks when the compiler toolchain works, else eager with a
    # message (docs/performance.md).
    compile: str = "none"


@dataclass
class ParallelSection:
    dp: int = 0  # 0: whatever the world size leaves after tp*pp*cp
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    # Over a ZeRO group (dp x cp) of one rank every stage runs as 0: nothing to shard.
    zero_stage: int = 0
    # ZeRO 0-2: gradient bucket size; ZeRO-3: consecutive blocks gathered as one unit
    # up to this size (docs/zero.md).
    bucket_mb: float = 25.0
    prefetch: int = 1  # ZeRO-3: gather units fetched ahead of the one computing
    # ZeRO-3: the last gather units kept gathered from forward into backward (each one
    # more costs its memory and saves its second all-gather per microbatch).
    keep_gathered: int = 1
    # ZeRO-2 gradient accumulation: "reduce" reduce-scatters every microbatch (least
    # memory); "buffer" keeps a full-size gradient buffer and reduces once per step.
    accumulation: str = "reduce"
    sequence_parallel: bool = False
    schedule: str = "1f1b"  # gpipe, 1f1b, interleaved-1f1b, zb-h1 (partita.layout.SCHEDULES)
    virtual_stages: int = 0  # model chunks per pipeline rank; 0 = the schedule's default
    pp_balance: str = "even"  # how blocks split into stages: even, params or flops
    # A pipeline rank that waits longer than this for a peer's tensor stops with a message
    # naming the stage, action and microbatch, instead of hanging forever.
    pp_timeout_s: float = 300.0
    # Communication overlap (partita.layout.Layout): gradient buckets reduce during
    # backward; ZeRO parameter gathers run ahead of use; TP collectives chunked beside
    # GEMMs (not available yet).
    tp_comm_overlap: bool = False
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    # Activation recomputation: none, selective (the attention core) or full (whole
    # blocks); recompute_layers = K recomputes only the first K blocks of each stage.
    recompute: str = "none"
    recompute_layers: int = 0
    # What lives in host memory: none, optimizer (master weights and Adam moments, the
    # update on the CPU) or optimizer+params (ZeRO-3 parameter shards too);
    # optimizer+disk keeps master weights and moments in files under offload_dir,
    # streamed through host buffers of at most host_memory_budget_gb;
    # optimizer+params+disk also ZeRO-3's parameter shards.
    offload: str = "none"
    offload_dir: str = ""
    host_memory_budget_gb: float = 1.0
    # Context-parallel attention (cp > 1): "ring" passes keys and values round the
    # group, "allgather" gathers them once per layer (docs/context_parallel.md).
    cp_kind: str = "ring"
    # How MoE feed-forwards use the tp group (tp > 1): "replicate" keeps every expert on
    # every tp rank; "experts" splits the experts over the tp ranks, "hidden" each
    # expert's width, and both sum the ranks' partial outputs (docs/expert_parallel.md).
    moe_tp: str = "replicate"


@dataclass
class PrecisionSection:
    param_dtype: str = ""  # "" = train.dtype; bfloat16 / float16 train in mixed precision
    reduce_dtype: str = ""  # "" = param_dtype
    master_weights: bool = True  # fp32 master copy when param_dtype is 16-bit


@dataclass
class MetricsSection:
    peak_tflops: float = 0.0  # 0: look the device up (see partita.metrics)
    tensorboard: bool = True  # write TensorBoard events when tensorboard is installed
