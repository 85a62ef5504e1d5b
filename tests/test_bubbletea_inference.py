import torch

from geotrain.bubbletea.inference import KVCache, decode, forward_with_cache, prefill
from geotrain.models.llama import build_model
from geotrain.models.presets import PRESETS


def test_chunked_prefill_equals_the_full_forward():
    spec = PRESETS["tiny"]
    model = build_model(spec).eval()
    tokens = torch.randint(0, spec.vocab, (1, 40))
    full = model(tokens)[0, -1]
    for chunk in (40, 16, 7):
        cache = KVCache()
        for i in range(0, 40, chunk):
            last = forward_with_cache(model, tokens[:, i:i + chunk], cache)
        torch.testing.assert_close(last, full, rtol=1e-4, atol=1e-5)


def test_decode_with_cache_equals_recomputing_the_whole_sequence():
    spec = PRESETS["tiny"]
    model = build_model(spec).eval()
    prompt = [5, 17, 99, 3, 42]
    first, cache = prefill(model, prompt, chunk=2)
    got = [first] + list(decode(model, first, cache, 6))
    seq = list(prompt)
    want = []
    with torch.no_grad():
        for _ in range(7):
            nxt = int(torch.argmax(model(torch.tensor([seq]))[0, -1]))
            want.append(nxt)
            seq.append(nxt)
    assert got == want


def test_kv_cache_round_trips_through_raw_bytes():
    spec = PRESETS["tiny"]
    model = build_model(spec).eval()
    _, cache = prefill(model, [1, 2, 3, 4])
    data, shape, dtype = cache.to_bytes()
    back = KVCache.from_bytes(data, shape, dtype)
    assert back.length == 4
    for a, b in zip(cache.keys + cache.values, back.keys + back.values):
        torch.testing.assert_close(a, b)
