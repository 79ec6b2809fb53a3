"""Context parallelism: fa2cupy's ring attention on every GPU of the machine against torch's own context_parallel
over SDPA cuDNN, forward + backward, with both on one GPU over the whole sequence for the scaling efficiency.

    python bench/cp_speed.py --seqlen 131072 --nheads 16 --headdim 128 [--gpus N] [--layout zigzag] [--repeats 5]
                             [--forward-only] [--skip-single] [--skip-torch]
    (from the repository root, after ``pip install -e .``: the harness is the installed package ``fa2cupy_bench``)

One process a GPU (spawned here, NCCL), bf16, b = 1, causal unless --no-causal. Each figure is the slowest rank's
median CUDA-event time (the harness's time_gpu: 2 warm-ups, then --repeats back to back, all ranks starting after a
barrier) for out = attention(q, k, v); out.backward(dout). One GPU's figures come from rank 0
alone over the full sequence, the others waiting. Peak memory is torch's max_memory_allocated on rank 0 during the
ring iterations (inputs included).
"""

from __future__ import annotations

import argparse
import os
import socket


def _timed(fn, repeats):
    """The harness's median of CUDA-event times (2 warm-ups; never fewer repeats on one rank than another, which
    would leave the others waiting in the ring's collectives)."""
    from fa2cupy_bench import harness as B

    return B.time_gpu(fn, B.TorchEvents(), warmup=2, repeats=repeats, max_seconds=float("inf")).median_ms


def _worker(rank, world, port, args, results):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fa2cupy
    import fa2cupy.torch as fa_torch
    from fa2cupy.distributed import ring

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    dev = torch.device("cuda", rank)
    s, h, d = args.seqlen, args.nheads, args.headdim
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, dout = (torch.randn((1, s, h, d), generator=g, device=dev, dtype=torch.bfloat16) for _ in range(4))
    barrier = dist.barrier
    out_times = {}

    def slowest(ms):
        t = torch.tensor([ms], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    # one GPU, the whole sequence (rank 0; the others wait at the barrier after)
    if rank == 0 and not args.skip_single:
        whole = [x.clone().requires_grad_() for x in (q, k, v)]

        def single():
            out = fa_torch.flash_attn_func(*whole, causal=args.causal)
            if not args.forward_only:
                out.backward(dout)

        out_times["fa2cupy, 1 GPU"] = _timed(single, args.repeats)
        qt, kt, vt = (x.transpose(1, 2).clone().requires_grad_() for x in (q, k, v))

        def single_cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal)
                if not args.forward_only:
                    out.backward(dout.transpose(1, 2))

        out_times["SDPA cuDNN, 1 GPU"] = _timed(single_cudnn, args.repeats)
        whole = qt = kt = vt = None  # (freed before the ring runs)
        torch.cuda.empty_cache()
    barrier()

    # fa2cupy's ring
    mine = [ring.shard(x, layout=args.layout) for x in (q, k, v, dout)]
    slices = [x.requires_grad_() for x in mine[:3]]
    torch.cuda.reset_peak_memory_stats()

    options = fa2cupy.KernelOptions(sm_count=args.sm_count) if args.sm_count else None

    def ring_step():
        out = ring.ring_flash_attn_func(*slices, causal=args.causal, layout=args.layout, kernel_options=options)
        if not args.forward_only:
            out.backward(mine[3])

    barrier()
    out_times[f"fa2cupy ring, {world} GPUs"] = slowest(_timed(ring_step, args.repeats))
    peak = torch.cuda.max_memory_allocated() / 2**30
    slices = mine = None
    torch.cuda.empty_cache()

    # torch's context_parallel over cuDNN (shards the buffers in place, load-balanced)
    if not args.skip_torch:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh("cuda", (world,))
        qt, kt, vt, dt = (x.transpose(1, 2).contiguous() for x in (q, k, v, dout))
        with context_parallel(mesh, buffers=[qt, kt, vt, dt], buffer_seq_dims=[2, 2, 2, 2]):
            local = [x.detach().requires_grad_() for x in (qt, kt, vt)]

            def torch_cp():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    out = F.scaled_dot_product_attention(*local, is_causal=args.causal)
                    if not args.forward_only:
                        out.backward(dt)

            barrier()
            out_times[f"torch context_parallel cuDNN, {world} GPUs"] = slowest(_timed(torch_cp, args.repeats))
    if rank == 0:
        results.put((out_times, peak))
    barrier()
    dist.destroy_process_group()


def main():
    import torch
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqlen", type=int, default=131072)
    parser.add_argument("--nheads", type=int, default=16)
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--gpus", type=int, default=0, help="GPUs (default: all)")
    parser.add_argument("--layout", default="zigzag")
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-single", action="store_true", help="skip the one-GPU runs (e.g. 1M tokens)")
    parser.add_argument("--skip-torch", action="store_true", help="skip torch's context_parallel")
    parser.add_argument("--forward-only", action="store_true", help="time the forward alone")
    parser.add_argument("--sm-count", type=int, default=0,
                        help="KernelOptions.sm_count for the ring's kernels (persistent grids on fewer SMs)")
    args = parser.parse_args()
    world = args.gpus or torch.cuda.device_count()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(world, port, args, results), nprocs=world, start_method="spawn")
    times, peak = results.get()
    flops = (4 * args.seqlen * args.seqlen * args.nheads * args.headdim * (0.5 if args.causal else 1.0)
             * (1.0 if args.forward_only else 3.5))
    print(f"cp_speed on {world} x {torch.cuda.get_device_name(0)}: seqlen {args.seqlen}, {args.nheads} heads of "
          f"{args.headdim}, bf16, {'causal' if args.causal else 'non-causal'}, layout {args.layout}, "
          f"{'forward' if args.forward_only else 'forward + backward'}, median of {args.repeats}")
    single = times.get("fa2cupy, 1 GPU")
    for name, ms in times.items():
        extra = ""
        if single and "ring" in name:
            extra = f"  scaling efficiency {single / (ms * world):.3f}"
        print(f"  {name:<40} {ms:9.2f} ms  {flops / ms / 1e9:7.1f} TFLOPs/s{extra}")
    ring_ms = next(ms for name, ms in times.items() if "ring" in name)
    torch_ms = next((ms for name, ms in times.items() if "context_parallel" in name), None)
    if torch_ms:
        print(f"  fa2cupy ring / torch context_parallel speed: {torch_ms / ring_ms:.3f}x")
    print(f"  peak memory on rank 0 (ring): {peak:.2f} GiB")


if __name__ == "__main__":
    main()
