"""Images end to end on a tiny random LLaVA: greedy tokens equal transformers', prefix caching by image content.

The reference is transformers' ``LlavaForConditionalGeneration`` given its own ``CLIPImageProcessor``'s pixels and
the prompt with each ``<image>`` expanded to :data:`LLAVA_IMAGE_TOKENS` image tokens; Spindle gets the images as PIL
images, PNG bytes through ``LLM.generate``, or PNG bytes through gRPC.
"""

import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from conftest import LLAVA_IMAGE_TOKENS
from PIL import Image
from test_grpc import ServerThread, assert_invalid, collect, refusal, tiny_config

from spindle import LLM, SamplingParams
from spindle.backend.encoder_cache import EncoderCache
from spindle.backend.engine_core import EngineCore
from spindle.backend.scheduler_output import SchedulerOutput
from spindle.frontend.engine.connection import start_backend
from spindle.frontend.processing.tokenizer import Tokenizer
from spindle.shared.errors import InvalidRequestError
from spindle.shared.protocol import EngineRequest, ImageInput
from spindle.v1 import spindle_pb2

IMAGE_TOKEN = 256
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
GRPC_GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


def random_image(seed: int, width: int, height: int) -> Image.Image:
    """Smooth random colours (a small random image scaled up), so that resizing keeps them apart."""
    small = np.random.default_rng(seed).integers(0, 256, (4, 4, 3), dtype=np.uint8)
    return Image.fromarray(small).resize((width, height), Image.Resampling.BILINEAR)


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


IMAGES = [random_image(1, 40, 60), random_image(2, 90, 30), random_image(3, 28, 28)]

# (prompt, indices into IMAGES): images of different sizes, two images in one prompt, and text-only prompts.
PROMPTS = [
    ("USER: <image>\nWhat is shown? ASSISTANT:", [0]),
    ("Plain text, no image at all", []),
    ("USER: compare <image> with <image> please ASSISTANT:", [1, 2]),
    ("USER: <image>\nDescribe it in detail. ASSISTANT:", [1]),
    ("Another text prompt", []),
]


@pytest.fixture(scope="module")
def reference(tiny_llava_dir: Path, clip_processor: transformers.CLIPImageProcessor) -> list[list[int]]:
    """Transformers' greedy tokens for each of :data:`PROMPTS`."""
    model = transformers.LlavaForConditionalGeneration.from_pretrained(tiny_llava_dir, dtype=torch.float32).eval()
    processor = clip_processor
    tokenizer = Tokenizer.from_dir(tiny_llava_dir)
    outputs = []
    for prompt, indices in PROMPTS:
        ids = []
        for token in tokenizer.encode(prompt):
            ids += [IMAGE_TOKEN] * LLAVA_IMAGE_TOKENS if token == IMAGE_TOKEN else [token]
        kwargs = {}
        if indices:
            kwargs["pixel_values"] = processor([IMAGES[i] for i in indices], return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens, do_sample=False, **kwargs)
        outputs.append(out[0, len(ids) :].tolist())
    return outputs


IMAGE_FORMS = {
    "pil": lambda image, _: image,
    "png": lambda image, _: png(image),
    "uint8-array": lambda image, _: np.asarray(image),  # raw pixels, [height, width, 3]
    "pixel-values": lambda image, processor: processor(image, return_tensors="pt")["pixel_values"],  # preprocessed
}


@pytest.fixture(scope="module")
def clip_processor(tiny_llava_dir: Path) -> transformers.CLIPImageProcessor:
    return transformers.CLIPImageProcessor.from_pretrained(tiny_llava_dir)


def prompt_inputs(form: str, processor: transformers.CLIPImageProcessor | None = None) -> list[dict]:
    """:data:`PROMPTS` as prompt dicts, their images in one of :data:`IMAGE_FORMS` (pixel values need ``processor``)."""
    inputs = []
    for prompt, indices in PROMPTS:
        entry: dict = {"prompt": prompt}
        if indices:
            images = [IMAGE_FORMS[form](IMAGES[i], processor) for i in indices]
            entry["multi_modal_data"] = {"image": images if len(images) > 1 else images[0]}
        inputs.append(entry)
    return inputs


class EncoderSpy:
    """Records the vision encoder's work and which steps mix image and text sequences.

    ``encoded`` lists the content hash of every image the runner encoded, in order; ``images_encoded`` counts the
    images the encoder itself ran on (the two agree unless a step encoded one image twice).
    """

    def __init__(self, core: EngineCore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.images_encoded = 0
        self.encoded: list[bytes] = []
        self.mixed_steps = 0
        runner = core.runner
        embed_images, encode_images, execute = runner.model.embed_images, runner._encode_images, runner.execute

        def counting_embed(pixels: torch.Tensor) -> torch.Tensor:
            self.images_encoded += pixels.shape[0]
            return embed_images(pixels)

        def recording_encode(images: list[ImageInput]) -> dict[bytes, torch.Tensor]:
            self.encoded += [image.content_hash for image in images]
            return encode_images(images)

        def watching_execute(scheduled: SchedulerOutput) -> None:
            execute(scheduled)
            with_images = {bool(runner.states[seq_id].images) for seq_id in scheduled.num_scheduled_tokens}
            self.mixed_steps += with_images == {True, False}

        monkeypatch.setattr(runner.model, "embed_images", counting_embed)
        monkeypatch.setattr(runner, "_encode_images", recording_encode)
        monkeypatch.setattr(runner, "execute", watching_execute)


@pytest.fixture
def llm(tiny_llava_dir: Path) -> Iterator[LLM]:
    # A step budget of 12 tokens: every image's 16 placeholders span two or three chunks, beside other prompts. An
    # engine per test (under a second): the prefix cache one test fills would change what the next one encodes.
    llm = LLM(str(tiny_llava_dir), dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=12, block_size=8)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("form", IMAGE_FORMS)
def test_greedy_tokens_match_transformers(
    llm: LLM, reference: list[list[int]], form: str, clip_processor, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = EncoderSpy(llm.llm_engine.engine_core, monkeypatch)
    outputs = llm.generate(prompt_inputs(form, clip_processor), GREEDY, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == reference
    # Image and text prompts ran in the same steps, and every image's placeholders spanned two or three chunks; yet
    # each of the 3 images was encoded, none twice for one prompt (4 images in all, image 1 in two prompts: once if
    # the encoder cache still held it for the second), and no call encoded one twice.
    assert spy.mixed_steps > 0
    assert len(set(spy.encoded)) == 3 and spy.images_encoded == len(spy.encoded) <= 4


def test_the_deprecated_nchw_batch_is_split_per_prompt_end_to_end(
    llm: LLM, reference: list[list[int]], clip_processor
) -> None:
    """vLLM's old ``multi_modal_data=`` keyword with one preprocessed batch: prompt i gets ``images[i:i + 1]``."""
    single = [i for i, (_, indices) in enumerate(PROMPTS) if len(indices) == 1]
    batch = clip_processor([IMAGES[PROMPTS[i][1][0]] for i in single], return_tensors="pt")["pixel_values"]
    assert batch.shape == (2, 3, 28, 28)
    with pytest.warns(DeprecationWarning, match="multi_modal_data"):
        prompts = [PROMPTS[i][0] for i in single]
        outputs = llm.generate(prompts=prompts, sampling_params=GREEDY, multi_modal_data={"image": batch})
    assert [out.outputs[0].token_ids for out in outputs] == [reference[i] for i in single]


def test_preempted_image_prompts_keep_parity(
    tiny_llava_dir: Path, reference: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A cache of 8 blocks of 16 tokens for five prompts of 1-4 blocks each: sequences are preempted, and recomputed
    # with their images' embeddings from the encoder cache or encoded again.
    block_bytes = 2 * 2 * 2 * 16 * 16 * 4  # K and V, 2 layers, 2 KV heads, head size 16, 16 tokens, float32
    llm = LLM(
        str(tiny_llava_dir),
        dtype="float32",
        kv_cache_memory=8 * block_bytes,
        max_model_len=128,
        max_num_batched_tokens=12,
        enable_prefix_caching=False,
    )
    spy = EncoderSpy(llm.llm_engine.engine_core, monkeypatch)
    outputs = llm.generate(prompt_inputs("pil"), GREEDY, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == reference
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    # Once no sequence needs an image, the encoder cache keeps no more than its budget (one image here).
    cache = llm.llm_engine.engine_core.runner.encoder_cache
    assert len(set(spy.encoded)) == 3 and 0 < cache.num_tokens <= cache.max_tokens == LLAVA_IMAGE_TOKENS


def test_the_encoder_cache_keeps_needed_images_and_the_most_recent_within_its_budget() -> None:
    cache = EncoderCache(max_tokens=4)
    rows = {key: torch.full((2, 3), float(i)) for i, key in enumerate([b"a", b"b", b"c", b"d"])}

    def held() -> list[bytes]:
        return [key for key in rows if key in cache]

    cache.add({b"a": rows[b"a"], b"b": rows[b"b"]}, keep=())
    assert held() == [b"a", b"b"] and cache.num_tokens == 4
    assert torch.equal(cache.get(b"a"), rows[b"a"])  # a is now the most recently used: b leaves first
    cache.add({b"c": rows[b"c"]}, keep=())
    assert held() == [b"a", b"c"] and cache.num_tokens == 4
    # Images still needed stay, over the budget; the least recently used of the others leave.
    cache.add({b"d": rows[b"d"]}, keep={b"a", b"c", b"d"})
    assert held() == [b"a", b"c", b"d"] and cache.num_tokens == 6
    cache.add({b"b": rows[b"b"]}, keep={b"b"})
    assert held() == [b"b", b"d"] and cache.num_tokens == 4


def test_prefix_cache_keys_image_blocks_by_content(llm: LLM) -> None:
    prompt = "USER: <image>\nA question long enough to fill blocks after the image. ASSISTANT:"
    params = SamplingParams(temperature=0, max_tokens=2)

    def cached(seed: int) -> int:
        [out] = llm.generate({"prompt": prompt, "multi_modal_data": {"image": random_image(seed, 50, 50)}}, params)
        return out.num_cached_tokens

    assert cached(10) == 0
    num_prompt = len(llm.get_tokenizer().encode(prompt)) - 1 + LLAVA_IMAGE_TOKENS
    # The same image again: every full block but the last, which is computed for its logits.
    assert cached(10) == (num_prompt - 1) // 8 * 8
    # Another image: its placeholders start in the first block, so nothing is shared.
    assert cached(11) == 0
    # Same text and image under n=2: both completions read the same blocks and the image is encoded once.
    [out] = llm.generate(
        {"prompt": prompt, "multi_modal_data": {"image": random_image(12, 50, 50)}},
        SamplingParams(temperature=0, max_tokens=3, n=2),
    )
    assert out.outputs[0].token_ids == out.outputs[1].token_ids


def test_engine_core_refuses_images_that_do_not_fit(tiny_llava_dir: Path, tiny_llm_dir: Path) -> None:
    pixels = np.zeros((3, 28, 28), dtype=np.float32)
    ids = [5] * 4 + [IMAGE_TOKEN] * LLAVA_IMAGE_TOKENS + [6]

    def request(*images: ImageInput, prompt: list[int] = ids) -> EngineRequest:
        return EngineRequest("r", prompt, SamplingParams(max_tokens=2), 0.0, images=list(images))

    text_core = EngineCore(tiny_config(tiny_llm_dir))
    with pytest.raises(InvalidRequestError, match="takes text only") as error:
        text_core.add_request(request(ImageInput.from_pixels(pixels, 4, LLAVA_IMAGE_TOKENS)))
    assert error.value.field == "prompt.multi_modal_data"

    core = EngineCore(tiny_config(tiny_llava_dir))
    refusals = [
        (ImageInput.from_pixels(np.zeros((3, 14, 14)), 4, LLAVA_IMAGE_TOKENS), "shape"),
        (ImageInput.from_pixels(pixels, 4, LLAVA_IMAGE_TOKENS - 1), "placeholder tokens; the model"),
        (ImageInput.from_pixels(pixels, 3, LLAVA_IMAGE_TOKENS), "other than the image token"),
        (ImageInput.from_pixels(pixels, 10, LLAVA_IMAGE_TOKENS), "outside the prompt"),
    ]
    for image, message in refusals:
        with pytest.raises(InvalidRequestError, match=message) as error:
            core.add_request(request(image))
        assert error.value.field == "prompt.multi_modal_data[0]"
    assert not core.has_unfinished_requests()
    core.add_request(request(ImageInput.from_pixels(pixels, 4, LLAVA_IMAGE_TOKENS)))
    while core.has_unfinished_requests():
        core.step()


@pytest.fixture(scope="module")
def server(tiny_llava_dir: Path) -> Iterator[ServerThread]:
    process, address = start_backend(tiny_config(tiny_llava_dir, max_num_batched_tokens=12, block_size=8))
    server = ServerThread(address)
    yield server
    server.close()
    process.terminate()
    process.wait(30)


def test_grpc_generate_with_png_images(server: ServerThread, reference: list[list[int]]) -> None:
    with server.client(timeout=60) as client:
        for (prompt, indices), expected in zip(PROMPTS, reference, strict=True):
            images = [png(IMAGES[i]) for i in indices]
            choices, _ = collect(client.generate(prompt, images=images, **GRPC_GREEDY))
            assert choices[0]["token_ids"] == expected


def test_grpc_chat_with_image_parts_matches_llm_chat(server: ServerThread, llm: LLM) -> None:
    def conversation(image: object) -> list[dict]:
        return [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What is it?"}]},
        ]

    [expected] = llm.chat(conversation(IMAGES[0]), GREEDY, use_tqdm=False)
    with server.client(timeout=60) as client:
        choices, _ = collect(client.chat(conversation(png(IMAGES[0])), **GRPC_GREEDY))
    assert choices[0]["token_ids"] == expected.outputs[0].token_ids


@pytest.mark.parametrize(
    "images,fields,message",
    [
        ([b"not an image at all"], ["prompt.multi_modal_data[0]"], "image"),
        ([], ["prompt.multi_modal_data", "prompt.text"], "1 image placeholders (<image>) but 0 images"),
    ],
    ids=["undecodable", "no-image"],
)
def test_grpc_refuses_bad_images(server: ServerThread, images: list[bytes], fields: list[str], message: str) -> None:
    items = [spindle_pb2.MultiModalItem(mime_type="image/png", data=data) for data in images]
    request = spindle_pb2.GenerateRequest(
        prompt=spindle_pb2.Prompt(text="USER: <image> ASSISTANT:", multi_modal_data=items)
    )
    with server.client(timeout=60) as client:
        assert_invalid(refusal(lambda: client.stub.Generate(request, timeout=60)), fields, message)
        # Nothing else was lost: the server still serves.
        choices, _ = collect(client.generate("still here", temperature=0, max_tokens=2))
        assert len(choices[0]["token_ids"]) == 2
