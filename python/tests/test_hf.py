"""Tests of cudapool.hf: a request's pages (matched, written, sealed, private, the block
table) over an in-process pool of Replica's semantics and over a real kvpoold (the
software device where no GPU is), the models it refuses, and, where torch and
transformers import, its Cache and attention on the CPU against transformers' own
generate. The bookkeeping needs neither torch nor a GPU."""

import os
import types
import unittest
from helpers import CHILD_TIMEOUT, REQUIRE_GPU, cudapool

from cudapool import hf, kv

T = 16


def setUpModule():
    cudapool.init(os.environ["CUDAPOOL_RUNTIME"])


def have(*mods):
    import importlib.util
    return all(importlib.util.find_spec(m) is not None for m in mods)


class FakePool(hf.LocalPool):
    """cudapool.hf's in-process pool (fp32 on the CPU by default), recording its calls."""

    def __init__(self, pages=64, layers=2, kv_heads=2, head_dim=16, dtype="fp32", device="cpu"):
        super().__init__(layers, kv_heads, head_dim, T, pages, device=device, dtype=dtype)
        self.calls = []

    def alloc(self, n, timeout=None):
        self.calls.append(("alloc", n))
        return super().alloc(n, timeout)

    def seal(self, lease, hashes, stream=None, wait=False, timeout=None):
        self.calls.append(("seal", len(hashes), wait))
        return super().seal(lease, hashes, stream, wait, timeout)

    def match(self, hashes, stream=None, timeout=None):
        self.calls.append(("match", len(hashes)))
        return super().match(hashes, stream, timeout)

    def release(self, *leases, stream=None, timeout=None):
        self.calls.append(("release", len(leases)))
        return super().release(*leases, stream=stream, timeout=timeout)


def toks(n, seed=1):
    return [(seed * 7919 + i * 104729) % 1000 for i in range(n)]


class PagesTest(unittest.TestCase):
    def test_a_computed_request_writes_its_full_pages_and_keeps_the_rest_private(self):
        pool = FakePool()
        p = hf.Pages(pool, toks(70), 10)
        self.assertEqual(p.matched, 0)
        self.assertEqual(p.start, 0)
        self.assertEqual(p.prefix, 64)  # computed apart from the last 6 tokens
        self.assertEqual(len(p.hashes), 4)  # 70 tokens: 4 full pages
        self.assertEqual(p.to_seal, 4)
        self.assertEqual(len(p.private), 1)  # tokens 64..79: one page
        self.assertEqual(p.block_table, list(p.written.pages) + list(p.private.pages))
        self.assertEqual(len(set(p.block_table)), 5)
        written = list(p.written.pages)
        res = p.seal()
        self.assertEqual((res.visible, res.duplicates), (4, 0))
        self.assertIsNone(p.written)
        self.assertEqual(p.block_table[:4], written)  # the same pages, now leased for reading
        self.assertTrue(p.read.id in pool.leases and not p.read.writable)
        self.assertIn(("seal", 4, True), pool.calls)  # it waits until visible, then matches again
        p.release()
        self.assertEqual(pool.leases, {})
        self.assertEqual(len(pool.free), 64 - 4)  # the sealed pages stay, the private one is free
        p.release()  # a second release does nothing

    def test_a_second_request_matches_all_but_the_page_of_its_last_token(self):
        pool = FakePool()
        first = hf.Pages(pool, toks(64), 8)
        first.seal()
        first.release()
        p = hf.Pages(pool, toks(64), 8)  # 4 full pages: the 4th holds the last token, computed again
        self.assertEqual(p.matched, 3)
        self.assertEqual((p.start, p.prefix), (48, 48))
        self.assertEqual(p.to_seal, 1)
        self.assertEqual(p.block_table[:3], [pool.index[h] for h in p.hashes[:3]])
        res = p.seal()
        self.assertEqual((res.visible, res.duplicates), (0, 1))  # sealed first by the first request
        self.assertEqual(p.block_table[:4], [pool.index[h] for h in p.hashes])
        p.release()
        self.assertEqual(pool.leases, {})
        self.assertEqual(len(pool.free), 60)

    def test_a_longer_prompt_matches_the_shared_prefix_and_writes_the_rest(self):
        pool = FakePool()
        a = hf.Pages(pool, toks(40), 4)
        a.seal()
        a.release()
        p = hf.Pages(pool, toks(40) + toks(30, seed=2), 4)  # 70 tokens: 2 pages shared, 2 new
        self.assertEqual((p.matched, p.to_seal, p.start), (2, 2, 32))
        self.assertEqual(p.seal().visible, 2)
        p.release()
        self.assertEqual(len(pool.index), 4)

    def test_shared_limits_what_is_matched_and_sealed(self):
        pool = FakePool()
        p = hf.Pages(pool, toks(50), 4, shared=32)  # a 32-token system prompt, then the user's
        self.assertEqual(len(p.hashes), 2)
        self.assertEqual((p.to_seal, p.prefix), (2, 32))
        self.assertEqual(len(p.private), 2)  # tokens 32..53
        p.seal()
        p.release()
        self.assertEqual(len(pool.index), 2)
        with self.assertRaises(ValueError):
            hf.Pages(pool, toks(50), 4, shared=51)

    def test_without_share_nothing_is_matched_or_sealed(self):
        pool = FakePool()
        a = hf.Pages(pool, toks(48), 4)
        a.seal()
        a.release()
        p = hf.Pages(pool, toks(48), 4, share=False)
        self.assertEqual((p.matched, p.start, p.to_seal, len(p.hashes)), (0, 0, 0, 0))
        self.assertEqual(p.prefix, 32)  # computed as a matching request would: 2 pages, then the rest
        self.assertEqual(len(p.block_table), 4)  # 52 tokens
        self.assertIsNone(p.seal())
        p.release()
        self.assertEqual(pool.leases, {})
        self.assertNotIn("seal", [c[0] for c in pool.calls[-3:]])

    def test_no_space_leaves_nothing_leased(self):
        pool = FakePool(pages=8)
        a = hf.Pages(pool, toks(64), 0)
        a.seal()
        a.release()  # 4 pages sealed, 4 free
        with self.assertRaises(kv.NoSpace):
            hf.Pages(pool, toks(64), 100)  # 3 matched, 1 to write, 7 private: 8 > 4 free
        self.assertEqual(pool.leases, {})
        self.assertEqual(len(pool.free), 4)

    def test_a_prefix_evicted_between_seal_and_match_is_an_error_that_loses_nothing(self):
        pool = FakePool()
        p = hf.Pages(pool, toks(64), 4)
        real_seal = pool.seal

        def seal_then_evict(lease, hashes, **kw):
            res = real_seal(lease, hashes, **kw)
            del pool.index[hashes[-1]]  # another replica's alloc evicted it
            return res

        pool.seal = seal_then_evict
        with self.assertRaisesRegex(RuntimeError, "only 3 of the prefix's 4 match again"):
            p.seal()
        p.release()
        self.assertEqual(pool.leases, {})

    def test_the_local_pool_refuses_a_lease_it_does_not_hold(self):
        pool = FakePool()
        a = pool.alloc(2)
        pool.release(a)
        with self.assertRaises(kv.StaleLease):
            pool.release(a)
        b = pool.alloc(1)
        with self.assertRaises(kv.StaleLease):
            pool.release(b, a)  # none is released
        self.assertIn(b.id, pool.leases)
        with self.assertRaises(kv.StaleLease):
            pool.seal(a, [])
        pool.release(b)
        self.assertEqual(len(pool.free), 64)

    def test_bad_requests(self):
        pool = FakePool()
        with self.assertRaises(ValueError):
            hf.Pages(pool, [], 4)
        with self.assertRaises(ValueError):
            hf.Pages(pool, toks(4), -1)
        self.assertEqual(pool.leases, {})


def config(**kw):
    base = dict(model_type="llama", num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                head_dim=64, hidden_size=2048)
    base.update(kw)
    return types.SimpleNamespace(**base)


class RefusalTest(unittest.TestCase):
    def test_served(self):
        for t in hf.SUPPORTED:
            self.assertIsNone(hf.refusal(config(model_type=t)), t)
        self.assertIsNone(hf.refusal(config(model_type="qwen3", sliding_window=4096, use_sliding_window=False,
                                            layer_types=["full_attention"] * 16)))
        self.assertEqual(hf.model_geometry(config(head_dim=None, num_key_value_heads=None)), (16, 32, 64))

    def test_refused_by_name(self):
        cases = [
            (config(model_type="mistral", sliding_window=4096), "sliding window of 4096"),
            (config(layer_types=["full_attention", "sliding_attention"]), "sliding_attention"),
            (config(model_type="deepseek_v3", kv_lora_rank=512), "multi-head latent attention"),
            (config(model_type="mllama", cross_attention_layers=[3, 8]), "cross-attention"),
            (config(model_type="t5", is_encoder_decoder=True), "encoder-decoder"),
            (config(model_type="gemma2", attn_logit_softcapping=50.0), "soft-caps"),
            (config(model_type="llama4", attention_chunk_size=8192), "chunks of 8192"),
            (config(model_type="gpt2"), "model type 'gpt2'"),
            (config(head_dim=96), "head dim of 96"),
            (config(num_key_value_heads=5), "not a multiple"),
        ]
        for c, words in cases:
            why = hf.refusal(c)
            self.assertIsNotNone(why, words)
            self.assertIn(words, why)
            with self.assertRaises(hf.Unsupported):
                hf.check_model(c, "bf16", kv.Geometry(16, 8, 64, "bf16", 16, 64))

    def test_geometry_mismatch_names_both(self):
        g = kv.Geometry(20, 4, 128, "bf16", 16, 64)
        with self.assertRaises(hf.GeometryMismatch) as e:
            hf.check_model(config(), "bf16", g)
        msg = str(e.exception)
        self.assertIn("16 layers, 8 KV heads, head dim 64, bf16", msg)
        self.assertIn("20 layers, 4 KV heads, head dim 128, bf16", msg)
        with self.assertRaisesRegex(hf.GeometryMismatch, "fp16"):
            hf.check_model(config(), "fp16", kv.Geometry(16, 8, 64, "bf16", 16, 64))
        self.assertIsNone(hf.check_model(config(), "bf16", kv.Geometry(16, 8, 64, "bf16", 16, 64)))


class OwnerPagesTest(unittest.TestCase):
    """Pages over a real owner: what one request seals, the next matches."""

    def test_pages_over_kvpoold(self):
        from test_kv import Owner
        o = Owner(pages=64)
        try:
            with o.replica() as a:
                b = a
                p = hf.Pages(a, toks(70), 10)
                self.assertEqual((p.matched, p.to_seal, len(p.private)), (0, 4, 1))
                res = p.seal()
                self.assertEqual((res.visible, res.duplicates), (4, 0))
                q = hf.Pages(b, toks(70), 10)
                self.assertEqual(q.matched, 4)  # 70 tokens: the last is in the private page
                self.assertEqual(q.block_table[:4], p.block_table[:4])
                self.assertEqual(q.to_seal, 0)
                q.release()
                p.release()
                st = a.stats(timeout=CHILD_TIMEOUT)["devices"][0]
                self.assertEqual(st["sealed"], 4)
                self.assertEqual(st["leased"] + st["writing"], 0)
        finally:
            o.stop()


@unittest.skipUnless(have("torch"), "no torch: the Cache and attention tests need it")
class CacheTest(unittest.TestCase):
    def test_update_writes_the_slots_of_the_block_table(self):
        if not have("transformers"):
            self.skipTest("no transformers")
        import torch
        pool = FakePool(layers=2, kv_heads=2, head_dim=16)
        cache = hf.PoolCache(pool.kv_caches(), 40, block_table=[5, 9, 2])
        k = torch.randn(1, 2, 20, 16)
        v = torch.randn(1, 2, 20, 16)
        cache.update(k, v, 0)
        K, V = pool.kv_caches()[0]
        self.assertTrue(torch.equal(K[5], k[0, :, :16].transpose(0, 1)))
        self.assertTrue(torch.equal(V[9, :4], v[0, :, 16:].transpose(0, 1)))
        self.assertEqual(cache.get_seq_length(0), 20)
        self.assertEqual(cache.get_seq_length(1), 0)
        with self.assertRaises(ValueError):
            cache.update(torch.randn(1, 2, 30, 16), torch.randn(1, 2, 30, 16), 0)  # past its 40 tokens
        with self.assertRaises(hf.Unsupported):
            cache.update(torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16), 1)
        with self.assertRaises(hf.Unsupported):
            cache.reorder_cache(torch.tensor([0]))


TINY = {
    "llama": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False),
    "qwen3": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=False,
                  use_sliding_window=False),
}


@unittest.skipUnless(have("torch", "transformers"), "no torch and transformers")
class TinyModelTest(unittest.TestCase):
    """Tiny random models on the CPU: the pool's greedy tokens equal generate's."""

    def model(self, arch):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        torch.manual_seed(0)
        cfg = AutoConfig.for_model(arch, **TINY[arch])
        m = AutoModelForCausalLM.from_config(cfg).float().eval()
        m.generation_config.eos_token_id = None
        m.generation_config.pad_token_id = 0
        return m

    def test_greedy_tokens_equal_generate(self):
        import torch
        for arch in TINY:
            m = self.model(arch)
            prompt = [t % 256 for t in toks(75)]  # the tiny models' vocabulary
            ids = torch.tensor([prompt])
            with torch.no_grad():
                ref = m.generate(ids, max_new_tokens=12, do_sample=False)[0].tolist()
            c = m.config
            pool = FakePool(pages=64, layers=c.num_hidden_layers, kv_heads=c.num_key_value_heads,
                            head_dim=c.head_dim)
            with self.assertRaisesRegex(hf.Unsupported, "attn_implementation"):
                hf.Generator(m, pool)
            m.config._attn_implementation = hf.register()
            gen = hf.Generator(m, pool)
            a = gen.generate(prompt, 12)[0].tolist()
            self.assertEqual(gen.last["matched_pages"], 0)
            self.assertEqual(gen.last["sealed"], 4)
            b = gen.generate(prompt, 12)[0].tolist()
            self.assertEqual(gen.last["matched_pages"], 4)
            self.assertEqual(gen.last["computed_tokens"], 11)
            self.assertEqual(a, ref, arch)
            self.assertEqual(b, ref, arch)
            self.assertEqual(pool.leases, {})
            # model.generate over a PoolCache: the matched pages are not computed again
            with hf.PoolCache.for_request(m, pool, ids, 12) as cache:
                self.assertEqual(cache.get_seq_length(), 64)
                with torch.no_grad():
                    out = m.generate(ids, past_key_values=cache, max_new_tokens=12, do_sample=False)
            self.assertEqual(out[0].tolist(), ref, arch)
            self.assertEqual(pool.leases, {})
            # the five-line use: one Generator per (model, pool), kept by the model
            self.assertIs(hf.generator(m, pool), hf.generator(m, pool))
            self.assertEqual(hf.cudapool_generate(m, pool, ids, max_new_tokens=12)[0].tolist(), ref, arch)
            self.assertEqual(pool.leases, {})
            with self.assertRaises(hf.GeometryMismatch):
                hf.Generator(m, FakePool(layers=c.num_hidden_layers + 1, kv_heads=c.num_key_value_heads,
                                         head_dim=c.head_dim))
            # over transformers' own cache it attends as sdpa for one sequence, and refuses batches
            with torch.no_grad():
                self.assertEqual(m.generate(ids, max_new_tokens=12, do_sample=False)[0].tolist(), ref, arch)
                with self.assertRaisesRegex(hf.Unsupported, "batch of 2"):
                    m(input_ids=ids.repeat(2, 1))

    def test_sliding_window_model_is_refused(self):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        cfg = AutoConfig.for_model("mistral", **dict(TINY["llama"], sliding_window=32))
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(cfg).float().eval()
        m.config._attn_implementation = hf.register()
        with self.assertRaisesRegex(hf.Unsupported, "sliding window of 32"):
            hf.Generator(m, FakePool(layers=2, kv_heads=2, head_dim=16))


if __name__ == "__main__":
    unittest.main()
