"""DeviceDecode: raw batches decoded in the training process, with the CPU path's crops and flips.

What a machine without a GPU checks: ``device="cpu"`` gives exactly ``DecodeBatch``'s
tensors for the same dataset and epoch (through DataLoader worker processes and through
the thread ``Loader``), the raw batch carries each sample's (epoch, position), the boxes
the GPU path draws are the ones Pillow's own resize reproduces DecodeBatch's pixels with,
the batched resampler the GPU runs matches Pillow's bilinear resize (run here on CPU
tensors), JPEG headers read like Pillow's, and every refusal is a ConfigError naming the
argument. The tests marked ``gpu`` run where CUDA is present (``pytest -m gpu``).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

import streamload
from streamload import ConfigError, DeviceDecode, Loader, SampleError, StreamingDataset
from streamload._jpeghead import jpeg_head
from streamload._resample import resample_boxes
from streamload.batch import RawBatch, RawCollate
from streamload.converters import ConvertOptions, ImageFolderSource, convert
from streamload.decode import DecodeBatch
from streamload.devicedecode import batch_geometry
from streamload.synthetic import make_image_folder, synthetic_jpeg

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (pytest -m gpu on a GPU machine)")


def _encode(array: np.ndarray, fmt: str = "JPEG", mode: str | None = None, **kw: Any) -> bytes:
    img = Image.fromarray(array)
    if mode is not None:
        img = img.convert(mode)
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


@pytest.fixture(scope="module")
def mixed_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Landscape and portrait JPEGs of many sizes (a few large: DCT-scaled on the CPU), a PNG,
    a progressive, a grey and a CMYK JPEG, converted to tar shards of 8."""
    root = tmp_path_factory.mktemp("device-images")
    make_image_folder(str(root / "src"), num_classes=3, per_class=10, size=(96, 72), seed=4, jitter=0.5)
    make_image_folder(str(root / "src"), num_classes=3, per_class=0, seed=5)
    rng = np.random.default_rng(9)
    extra = root / "src" / "class_000"
    for i, (w, h) in enumerate([(60, 110), (400, 300), (37, 53), (640, 200)]):
        (extra / f"extra_{i}.jpg").write_bytes(synthetic_jpeg(rng, w, h))
    pixels = (rng.random((50, 70, 3)) * 255).astype(np.uint8)
    (extra / "a_png.png").write_bytes(_encode(pixels, "PNG"))
    (extra / "progressive.jpg").write_bytes(_encode(pixels, progressive=True, quality=90))
    (extra / "grey.jpg").write_bytes(_encode(pixels, mode="L"))
    (extra / "cmyk.jpg").write_bytes(_encode(pixels, mode="CMYK"))
    out = root / "shards"
    convert(ImageFolderSource(str(root / "src")), str(out), ConvertOptions(samples_per_shard=8, progress=False))
    return out


def _raw(root: Path, **kw: Any) -> StreamingDataset:
    return StreamingDataset(str(root), batch_size=6, shuffle=True, seed=2, collate=RawCollate(keys=True), **kw)


def _decoded(root: Path, decode: DecodeBatch, **kw: Any) -> StreamingDataset:
    return StreamingDataset(str(root), batch_size=6, shuffle=True, seed=2, collate=decode, **kw)


SETTINGS: list[dict[str, Any]] = [
    {"size": 32, "crop": "random", "flip": True, "seed": 3},
    {"size": (24, 40), "crop": "center", "flip": True, "seed": 0, "resize": 30},
    {"size": 20, "crop": "center"},
]


def _pairs(dev: DeviceDecode, raw: Any, ref: Any) -> list[tuple[Any, Any]]:
    got = [dev(batch) for batch in raw]
    want = list(ref)
    assert len(got) == len(want) > 0
    return list(zip(got, want, strict=True))


@pytest.mark.parametrize("settings", SETTINGS, ids=["random-flip", "center-flip-rect", "center"])
@pytest.mark.slow
def test_cpu_is_decode_batch_bit_for_bit_through_dataloader_workers(
    mixed_images: Path, settings: dict[str, Any]
) -> None:
    kw = dict(settings)
    size = kw.pop("size")
    dev = DeviceDecode(size, device="cpu", **kw)
    ref_seed = kw.pop("seed", 0)
    raw_ds, ref_ds = _raw(mixed_images), _decoded(mixed_images, DecodeBatch(size, seed=ref_seed, **kw))
    raw_ds.set_epoch(1)
    ref_ds.set_epoch(1)
    raw = DataLoader(raw_ds, batch_size=None, num_workers=2)
    ref = DataLoader(ref_ds, batch_size=None, num_workers=2)
    for (images, labels), (ref_images, ref_labels) in _pairs(dev, raw, ref):
        assert images.dtype == torch.uint8 and images.shape == ref_images.shape
        assert images.is_contiguous()  # NCHW, not DecodeBatch's channels-last view
        assert torch.equal(images, ref_images)
        assert torch.equal(labels, ref_labels)
    assert dev.fallbacks.value == 0 and dev.decoder_name == "cpu"


def test_cpu_is_decode_batch_through_the_thread_loader_and_iterate(mixed_images: Path) -> None:
    dev = DeviceDecode(28, crop="random", flip=True, seed=7, device="cpu")
    raw_ds, ref_ds = _raw(mixed_images), _decoded(mixed_images, DecodeBatch(28, crop="random", flip=True, seed=7))
    raw_ds.set_epoch(2)
    ref_ds.set_epoch(2)
    got = list(dev.iterate(Loader(raw_ds, threads=2)))
    want = list(Loader(ref_ds, threads=2))
    assert len(got) == len(want) == len(raw_ds)
    for (images, labels), (ref_images, ref_labels) in zip(got, want, strict=True):
        assert torch.equal(images, ref_images) and torch.equal(labels, ref_labels)


def test_the_epoch_and_seed_change_the_crops(mixed_images: Path) -> None:
    def first(epoch: int, seed: int) -> torch.Tensor:
        ds = _raw(mixed_images)
        ds.set_epoch(epoch)
        images, _ = DeviceDecode(32, crop="random", flip=True, seed=seed, device="cpu")(next(iter(ds)))
        return images

    base = first(0, 0)
    assert torch.equal(base, first(0, 0))
    assert not torch.equal(base, first(1, 0)) and not torch.equal(base, first(0, 1))


def test_raw_batches_carry_each_samples_epoch_and_position(mixed_images: Path) -> None:
    """The fast read (straight from the readers) and the dict path give the places the dicts carry."""
    seen: list[tuple[int, int]] = []

    def note(sample: dict[str, Any]) -> dict[str, Any]:
        seen.append((sample["__epoch__"], sample["__position__"]))
        return sample

    fast, slow = _raw(mixed_images), _raw(mixed_images, transform=note)
    for ds in (fast, slow):
        ds.set_epoch(3)
    fast_batches, slow_batches = list(fast), list(slow)
    fast_places = torch.cat([b.places for b in fast_batches]).tolist()
    slow_places = torch.cat([b.places for b in slow_batches]).tolist()
    assert [tuple(p) for p in fast_places] == [tuple(p) for p in slow_places] == seen
    assert all(epoch == 3 for epoch, _ in seen) and len({p for _, p in seen}) == len(seen)
    # crossing a process (a DataLoader worker's shared-memory batch) and a plain pickle keep them
    worker = list(DataLoader(_raw(mixed_images), batch_size=None, num_workers=2))
    assert all(b.places is not None and b.places.shape == (len(b), 2) for b in worker)
    again = pickle.loads(pickle.dumps(fast_batches[0]))  # noqa: S301 - our own object
    assert torch.equal(again.places, fast_batches[0].places)
    assert torch.equal(fast_batches[0].to("cpu").places, again.places)
    assert streamload.batch.RawCollate(places=False)([{"__key__": "k", "jpg": b"x", "cls": b"1"}]).places is None


def test_random_crops_need_places(mixed_images: Path) -> None:
    ds = StreamingDataset(str(mixed_images), batch_size=4, collate=RawCollate(places=False))
    batch = next(iter(ds))
    assert batch.places is None
    images, _ = DeviceDecode(16, crop="center", device="cpu")(batch)  # nothing random: fine
    assert images.shape == (4, 3, 16, 16)
    with pytest.raises(ConfigError, match=r"RawCollate\(\)"):
        DeviceDecode(16, crop="random", device="cpu")(batch)
    with pytest.raises(ConfigError, match="places"):
        DeviceDecode(16, flip=True, device="cpu")(batch)


def test_the_gpu_paths_boxes_reproduce_decode_batch_with_pillow(mixed_images: Path) -> None:
    """batch_geometry's boxes and flips, applied by Pillow itself, give DecodeBatch's pixels.

    Output 64 and images of at most ~110 pixels: no DCT reduction on the CPU path, so its
    pixels are Pillow's full decode resized over the box (backend="pillow").
    """
    settings = {"crop": "random", "flip": True, "scale": (0.08, 1.0)}
    ds = StreamingDataset(str(mixed_images), batch_size=6, shuffle=True, seed=5, collate=RawCollate(keys=True))
    ref_collate = DecodeBatch(64, backend="pillow", seed=11, label_field=None, **settings)  # type: ignore[arg-type]
    dev = DeviceDecode(64, seed=11, device="cpu", backend="pillow", **settings)  # type: ignore[arg-type]
    compared = flips = 0
    for raw in ds:
        samples = [{"__key__": k, "jpg": raw.tobytes(i)} for i, k in enumerate(raw.keys)]
        for sample, (epoch, position) in zip(samples, raw.places.tolist(), strict=True):
            sample["__epoch__"], sample["__position__"] = epoch, position
        reference = ref_collate(samples).images
        pictures = [Image.open(io.BytesIO(raw.tobytes(i))) for i in range(len(raw))]
        small = [i for i, p in enumerate(pictures) if max(p.size) <= 128]
        sizes = [pictures[i].size for i in small]
        boxes, flipped = batch_geometry(dev.cpu, sizes, raw.places.numpy()[small], 11)
        for k, i in enumerate(small):
            img = pictures[i].convert("RGB").resize((64, 64), Image.Resampling.BILINEAR, box=boxes[k])
            if flipped[k]:
                img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            assert np.array_equal(np.asarray(img), reference[i].permute(1, 2, 0).numpy()), raw.keys[i]
            compared += 1
            flips += flipped[k]
    assert compared > 20 and 0 < flips < compared


def _stand_in(raws: list[np.ndarray], stream: Any) -> list[tuple[torch.Tensor, str] | None]:
    """A device decoder's stand-in on the CPU: Pillow's full decode; progressive JPEGs refused."""
    out: list[tuple[torch.Tensor, str] | None] = []
    for k, raw in enumerate(raws):
        img = Image.open(io.BytesIO(raw.tobytes()))
        if img.info.get("progressive") or img.info.get("progression"):
            out.append(None)
            continue
        array = torch.from_numpy(np.asarray(img.convert("RGB")).copy())
        out.append((array, "HWC") if k % 2 else (array.permute(2, 0, 1).contiguous(), "CHW"))
    return out


def test_the_device_path_routes_refusals_to_the_cpu_and_counts_them(mixed_images: Path) -> None:
    """The GPU path's code (headers, boxes, batched resize, flips, fallbacks, assembly) with a CPU stand-in decoder.

    What the device decoder takes comes out within one level of DecodeBatch's pixels
    (small images: no DCT reduction on the CPU path); what it cannot take (the PNG, the
    CMYK JPEG) or refuses (the progressive JPEG, here) is exactly DecodeBatch's, counted.
    """
    from streamload._gpudecode import GpuDecoder

    dev = DeviceDecode(64, crop="random", flip=True, seed=6, device="cpu", backend="pillow")
    dev._gpu = GpuDecoder(torch.device("cpu"), "stand-in", _stand_in)
    assert "decoder='stand-in'" in repr(dev)
    ref = DecodeBatch(64, crop="random", flip=True, seed=6, backend="pillow")
    ds = _raw(mixed_images)
    routed: list[str] = []
    resized = 0
    for raw in ds:
        images, labels = dev(raw)
        samples = [{"__key__": k, "jpg": raw.tobytes(i), "cls": b"0"} for i, k in enumerate(raw.keys)]
        for sample, (epoch, position) in zip(samples, raw.places.tolist(), strict=True):
            sample["__epoch__"], sample["__position__"] = epoch, position
        want = ref(samples).images
        for i, key in enumerate(raw.keys):
            if key.rsplit("/", 1)[-1] in ("a_png", "cmyk", "progressive"):
                assert torch.equal(images[i], want[i]), key
                routed.append(key.rsplit("/", 1)[-1])
            elif max(Image.open(io.BytesIO(raw.tobytes(i))).size) <= 128:
                diff = (images[i].int() - want[i].int()).abs()
                assert int(diff.max()) <= 1, key
                resized += 1
        assert torch.equal(labels, raw.labels)
    assert set(routed) == {"a_png", "cmyk", "progressive"} and resized > 20  # (a padded epoch repeats some)
    assert dev.fallbacks.value == len(routed)
    assert dev.device_stage_seconds()["decode"] > 0


def _pillow_resized(array: np.ndarray, box: tuple[float, ...], size: tuple[int, int]) -> np.ndarray:
    img = Image.fromarray(array.squeeze(-1) if array.shape[-1] == 1 else array).convert("RGB")
    return np.asarray(img.resize((size[1], size[0]), Image.Resampling.BILINEAR, box=box))


def test_the_batched_resampler_is_pillows_bilinear() -> None:
    """The GPU's crop + resize, run here on CPU tensors: within one level of Pillow, any scale or layout."""
    rng = np.random.default_rng(1)
    images, layouts, boxes, refs = [], [], [], []
    size = (24, 30)
    for k in range(24):
        h, w = (int(v) for v in rng.integers(6, 260, 2))
        channels = 1 if k % 5 == 4 else 3
        array = (rng.random((h, w, channels)) * 255).astype(np.uint8)
        if k % 4 == 0:
            box = (0.0, 0.0, float(w), float(h))
        else:
            x0, y0 = rng.uniform(0, w - 1), rng.uniform(0, h - 1)
            box = (x0, y0, rng.uniform(x0 + 0.5, w), rng.uniform(y0 + 0.5, h))
        tensor = torch.from_numpy(array)
        if k % 2:
            images.append(tensor.permute(2, 0, 1).contiguous())
            layouts.append("CHW")
        else:
            images.append(tensor)
            layouts.append("HWC")
        boxes.append(box)
        refs.append(_pillow_resized(array, box, size))
    out = resample_boxes(images, layouts, boxes, size)
    assert out.shape == (24, 3, *size) and out.dtype == torch.uint8
    exact = 0
    for k in range(24):
        diff = np.abs(out[k].permute(1, 2, 0).numpy().astype(int) - refs[k].astype(int))
        assert diff.max() <= 1, (k, boxes[k], images[k].shape)
        exact += int(diff.max() == 0)
    assert exact >= 6  # many are exactly Pillow's
    assert resample_boxes([], [], [], size).shape == (0, 3, *size)


def test_jpeg_headers_read_like_pillow() -> None:
    rng = np.random.default_rng(2)
    pixels = (rng.random((33, 47, 3)) * 255).astype(np.uint8)
    cases = {
        "baseline": (_encode(pixels), 0xC0, 3, True),
        "progressive": (_encode(pixels, progressive=True), 0xC2, 3, True),
        "grey": (_encode(pixels, mode="L"), 0xC0, 1, True),
        "cmyk": (_encode(pixels, mode="CMYK"), 0xC0, 4, False),
        "exif": (_encode(pixels, exif=Image.Exif().tobytes()), 0xC0, 3, True),
    }
    for name, (data, marker, components, gpu) in cases.items():
        head = jpeg_head(data)
        assert head is not None, name
        assert (head.width, head.height) == Image.open(io.BytesIO(data)).size == (47, 33), name
        assert (head.marker, head.components, head.precision, head.gpu_decodable) == (marker, components, 8, gpu)
        assert jpeg_head(np.frombuffer(data, dtype=np.uint8)) == head  # a batch's uint8 view reads the same
        assert jpeg_head(data[:20]) is None  # cut before the frame header
    assert jpeg_head(_encode(pixels, "PNG")) is None
    assert jpeg_head(b"") is None and jpeg_head(b"\xff\xd8\xff\xda\x00\x02") is None


def test_normalized_float_and_channels_last(mixed_images: Path) -> None:
    batch = next(iter(_raw(mixed_images)))
    plain, labels = DeviceDecode(20, crop="random", flip=True, device="cpu")(batch)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    normed, labels2 = DeviceDecode(20, crop="random", flip=True, device="cpu", mean=mean, std=std, channels_last=True)(
        batch
    )
    assert normed.dtype == torch.float32 and normed.is_contiguous(memory_format=torch.channels_last)
    expect = (plain.numpy().astype(np.float64) / 255 - np.array(mean).reshape(1, 3, 1, 1)) / np.array(std).reshape(
        1, 3, 1, 1
    )
    assert np.allclose(normed.numpy(), expect, atol=1e-5)
    assert torch.equal(labels, labels2) and labels.dtype == torch.int64
    half, _ = DeviceDecode(20, crop="random", flip=True, device="cpu", dtype=torch.float16)(batch)
    assert half.dtype == torch.float16 and torch.allclose(half.float(), plain.float() / 255, atol=1e-3)
    last, _ = DeviceDecode(20, crop="random", flip=True, device="cpu", channels_last=True)(batch)
    assert last.dtype == torch.uint8 and last.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(last, plain)


def test_a_bad_image_names_its_sample(mixed_images: Path) -> None:
    good = next(iter(_raw(mixed_images)))
    data = good.data.clone()
    data[int(good.offsets[2]) + 2 : int(good.offsets[3])] = 0  # sample 2: a JPEG marker, then zeros
    broken = RawBatch(data, good.offsets, good.labels, good.keys, places=good.places)
    with pytest.raises(SampleError, match=repr(good.keys[2])):
        DeviceDecode(16, device="cpu")(broken)
    tiny = DeviceDecode(16, device="cpu", max_pixels=100)
    with pytest.raises(SampleError, match="max_pixels"):
        tiny(good)


@pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without CUDA")
def test_cuda_without_cuda_is_a_config_error_saying_what_to_install() -> None:
    with pytest.raises(ConfigError, match=r"streamload\[gpu\]") as err:
        DeviceDecode(224, crop="random", flip=True)
    assert "CUDA" in str(err.value) and "device='cpu'" in str(err.value)
    with pytest.raises(ConfigError, match="CUDA"):
        DeviceDecode(224, device="cuda:1")


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"size": 0}, "size="),
        ({"size": (3, 0)}, "size="),
        ({"size": True}, "size="),
        ({"crop": "middle"}, "crop="),
        ({"flip": 1}, "flip="),
        ({"seed": -1}, "seed="),
        ({"seed": 1.5}, "seed="),
        ({"device": "tpu"}, "device="),
        ({"device": "meta"}, "device="),
        ({"resize": 0}, "resize="),
        ({"scale": (0.5, 0.1)}, "scale="),
        ({"scale": (0.1, 2.0)}, "scale="),
        ({"ratio": (0, 1)}, "ratio="),
        ({"mean": (0.5, 0.5, 0.5)}, "mean="),
        ({"mean": (0.5, 0.5), "std": (1, 1)}, "mean="),
        ({"mean": (0.5,) * 3, "std": (1, 0, 1)}, "std="),
        ({"mean": (0.5,) * 3, "std": (1,) * 3, "dtype": torch.uint8}, "uint8"),
        ({"dtype": torch.int32}, "dtype="),
        ({"channels_last": "yes"}, "channels_last="),
        ({"decoder": "dali"}, "decoder="),
        ({"backend": "turbo"}, "backend="),
        ({"max_pixels": 0}, "max_pixels="),
    ],
)
def test_arguments_are_checked_up_front(kw: dict[str, Any], named: str) -> None:
    args = {"size": 16, "device": "cpu", **kw}
    size = args.pop("size")
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")):
        DeviceDecode(size, **args)


def test_it_takes_raw_batches_only(mixed_images: Path) -> None:
    decoded = next(iter(_decoded(mixed_images, DecodeBatch(16))))
    with pytest.raises(ConfigError, match="RawCollate"):
        DeviceDecode(16, device="cpu")(decoded)  # type: ignore[arg-type]


def test_it_is_exported_lazily() -> None:
    import subprocess
    import sys

    assert "DeviceDecode" in streamload.__all__ and streamload.DeviceDecode is DeviceDecode
    code = "import sys, streamload; assert 'streamload.devicedecode' not in sys.modules; streamload.DeviceDecode"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_repr_and_pickle_say_what_runs() -> None:
    dev = DeviceDecode((24, 32), crop="random", flip=True, seed=4, device="cpu", mean=(0.5,) * 3, std=(0.25,) * 3)
    text = repr(dev)
    assert "decoder='cpu'" in text and "device='cpu'" in text and "crop='random'" in text and "float32" in text
    again = pickle.loads(pickle.dumps(dev))  # noqa: S301 - our own object
    assert repr(again) == text


# -- on a GPU (pytest -m gpu) -----------------------------------------------------------


def _on_gpu(size: int, decoder: str = "auto", **kw: Any) -> DeviceDecode:
    """A CUDA DeviceDecode, or a skip naming what is missing (the gpu extra, torchvision, JPEG engines)."""
    try:
        return DeviceDecode(size, decoder=decoder, **kw)
    except ConfigError as exc:
        pytest.skip(f"no GPU decoder {decoder!r} here: {exc}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("decoder", ["auto", "hardware", "nvjpeg"])
def test_gpu_decodes_close_to_the_cpu_path_and_counts_fallbacks(mixed_images: Path, decoder: str) -> None:
    gpu = _on_gpu(48, decoder, crop="random", flip=True, seed=3)
    cpu = DeviceDecode(48, crop="random", flip=True, seed=3, device="cpu")
    names = {
        "auto": ("nvimgcodec-hardware", "nvimgcodec-hardware+nvjpeg", "nvjpeg"),
        "hardware": ("nvimgcodec-hardware",),
        "nvjpeg": ("nvjpeg",),
    }
    assert gpu.decoder_name in names[decoder] and gpu.decoder_name in repr(gpu)
    for raw in _raw(mixed_images):
        images, labels = gpu(raw)
        ref, ref_labels = cpu(raw)
        assert images.is_cuda and images.dtype == torch.uint8 and images.shape == ref.shape
        assert torch.equal(labels.cpu(), ref_labels)
        # the same boxes and flips: the pixels differ only by decoder and DCT scaling
        diff = (images.cpu().float() - ref.float()).abs().mean(dim=(1, 2, 3))
        assert float(diff.max()) < 12, diff
    # the PNG and the CMYK JPEG at least went to the CPU, each counted
    assert gpu.fallbacks.value >= 2


@pytest.mark.gpu
@needs_cuda
def test_gpu_iterate_overlaps_and_times_the_decode_stage(mixed_images: Path) -> None:
    dev = _on_gpu(32, crop="random", flip=True, mean=(0.5,) * 3, std=(0.5,) * 3, channels_last=True)
    loader = DataLoader(_raw(mixed_images), batch_size=None, num_workers=2, pin_memory=True)
    watched = streamload.watch(dev.iterate(loader))
    batches = 0
    for images, labels in watched:
        assert images.is_cuda and images.dtype == torch.float32
        assert images.is_contiguous(memory_format=torch.channels_last)
        assert labels is not None and labels.is_cuda
        images.sum().item()
        batches += 1
    assert batches == len(loader)
    torch.cuda.synchronize()
    assert dev.device_stage_seconds()["decode"] > 0


@pytest.mark.gpu
@needs_cuda
def test_gpu_device_is_this_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    last = torch.cuda.device_count() - 1
    monkeypatch.setenv("LOCAL_RANK", str(last))
    assert _on_gpu(16).device == torch.device("cuda", last)
    monkeypatch.delenv("LOCAL_RANK")
    assert _on_gpu(16).device == torch.device("cuda", torch.cuda.current_device())
    assert _on_gpu(16, device="cpu").to(f"cuda:{last}").device == torch.device("cuda", last)


@pytest.mark.slow
def test_lightning_decodes_raw_batches_after_the_transfer(mixed_images: Path, tmp_path: Path) -> None:
    """StreamingDataModule(device_decode=...): training_step gets DecodeBatch's (images, labels)."""
    import lightning.pytorch as pl

    from streamload.lightning import StreamingDataModule

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            images, labels = batch
            seen.append((images.clone(), labels.clone()))
            return (self.weight * images.float().mean()) ** 2

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    decode = DeviceDecode(16, crop="random", flip=True, seed=5, device="cpu")
    dm = StreamingDataModule(mixed_images, batch_size=6, num_workers=2, device_decode=decode, seed=3)
    assert isinstance(dm.collate, RawCollate)
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(Model(), datamodule=dm)
    want = []
    for epoch in (0, 1):
        ref = StreamingDataset(
            str(mixed_images),
            batch_size=6,
            shuffle=True,
            seed=3,
            collate=DecodeBatch(16, crop="random", flip=True, seed=5),
        )
        ref.set_epoch(epoch)
        want.extend(ref)
    assert len(seen) == len(want) > 0
    for (images, labels), (ref_images, ref_labels) in zip(seen, want, strict=True):
        assert torch.equal(images, ref_images) and torch.equal(labels, ref_labels)
    with pytest.raises(ConfigError, match="device_decode="):
        StreamingDataModule(mixed_images, device_decode=DecodeBatch(16))  # type: ignore[arg-type]


def test_the_loaders_device_copy_keeps_the_places(mixed_images: Path) -> None:
    """Loader(device=...) moves a raw batch (RawBatch.to): its places come along, the decode is the same."""
    dev = DeviceDecode(20, crop="random", flip=True, device="cpu")
    plain = [dev(b) for b in Loader(_raw(mixed_images), threads=2)]
    moved = [dev(b) for b in Loader(_raw(mixed_images), threads=2, device="cpu")]
    assert len(plain) == len(moved) > 0
    for (a, la), (b, lb) in zip(plain, moved, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)


@pytest.mark.slow
def test_watch_reports_the_decode_stage_on_the_device(mixed_images: Path) -> None:
    from streamload.watch_report import DataReport

    dev = DeviceDecode(24, crop="random", flip=True, device="cpu")
    watched = streamload.watch(dev.iterate(DataLoader(_raw(mixed_images), batch_size=None, num_workers=2)))
    assert len(watched) == len(_raw(mixed_images))
    steps = sum(1 for _ in watched)
    report = watched.report()
    assert report.steps == steps > 0
    decode = report.device_stages["decode"]
    assert decode > 0 and report.readers > 0  # the workers' read stage is measured beside it
    assert "on the device: decode" in str(report)
    assert report.metrics()["data/device_decode_s"] == decode
    assert DataReport.from_dict(report.to_dict()).device_stages == report.device_stages
    mark = watched.mark()
    assert watched.report(since=mark).device_stages["decode"] == 0.0
    for _ in watched:
        pass
    assert watched.report(since=mark).device_stages["decode"] > 0
    plain = streamload.watch(DataLoader(_raw(mixed_images), batch_size=None))
    assert plain.report().device_stages == {}


def test_a_samples_crop_is_the_same_on_one_rank_or_two(mixed_images: Path) -> None:
    """RawBatch.places are the epoch's items, not the rank's: DeviceDecode crops a sample alike in any world."""
    dev = DeviceDecode(24, crop="random", flip=True, seed=9, device="cpu")

    def by_place(world: int) -> dict[tuple[int, int], torch.Tensor]:
        out: dict[tuple[int, int], torch.Tensor] = {}
        for rank in range(world):
            ds = StreamingDataset(
                str(mixed_images), batch_size=4, shuffle=True, seed=2, collate=RawCollate(), rank=rank, world_size=world
            )
            ds.set_epoch(1)
            for raw in ds:
                images, _ = dev(raw)
                for place, image in zip(raw.places.tolist(), images, strict=True):
                    out[(place[0], place[1])] = image
        return out

    one, two = by_place(1), by_place(2)
    common = one.keys() & two.keys()
    assert len(common) >= len(one) - 8 > 0  # all but the padding, which the worlds place differently
    assert all(torch.equal(one[p], two[p]) for p in common)


def test_iterate_ahead_or_not_gives_the_same_batches_and_ahead_false_keeps_the_loaders_count(
    mixed_images: Path,
) -> None:
    dev = DeviceDecode(16, crop="random", flip=True, device="cpu")
    ahead = list(dev.iterate(Loader(_raw(mixed_images), threads=2)))
    loader = Loader(_raw(mixed_images), threads=2)
    lazy = dev.iterate(loader, ahead=False)
    got = []
    for images, labels in lazy:
        got.append((images, labels))
        if len(got) == 2:
            assert lazy.state_dict()["samples_seen"] == 2 * 6  # what the loop received, nothing taken ahead
    assert len(got) == len(ahead) > 2
    assert all(torch.equal(a[0], b[0]) for a, b in zip(ahead, got, strict=True))
    with pytest.raises(ConfigError, match="ahead="):
        dev.iterate(loader, ahead=1)  # type: ignore[arg-type]


def test_a_second_device_decoder_takes_what_the_first_refuses(mixed_images: Path) -> None:
    """The hardware decoder's refusals go to the second decoder (nvJPEG on a GPU) before the CPU."""
    from streamload._gpudecode import GpuDecoder

    def everything(raws: list[np.ndarray], stream: Any) -> list[tuple[torch.Tensor, str] | None]:
        return [
            (torch.from_numpy(np.asarray(Image.open(io.BytesIO(r.tobytes())).convert("RGB")).copy()), "HWC")
            for r in raws
        ]

    # 64 px from the 70x50 progressive JPEG: no DCT reduction on the CPU path
    dev = DeviceDecode(64, crop="random", flip=True, device="cpu", backend="pillow")
    dev._gpu = GpuDecoder(torch.device("cpu"), "stand-in+retry", _stand_in, everything)
    ref = DeviceDecode(64, crop="random", flip=True, device="cpu", backend="pillow")
    on_cpu = 0
    for raw in _raw(mixed_images):
        images, _ = dev(raw)
        expect, _ = ref(raw)
        for i, key in enumerate(raw.keys):
            name = key.rsplit("/", 1)[-1]
            on_cpu += name in ("a_png", "cmyk")
            if name in ("a_png", "cmyk"):
                assert torch.equal(images[i], expect[i])
            elif name == "progressive":  # refused by the first, resized from the second's decode
                assert int((images[i].int() - expect[i].int()).abs().max()) <= 1
    assert dev.fallbacks.value == on_cpu > 0  # the progressive JPEG is not a CPU fallback


@pytest.mark.gpu
@needs_cuda
def test_gpu_queueing_a_batch_never_waits_for_the_device(mixed_images: Path) -> None:
    """start() only queues work: torch's sync debug mode raises on any synchronizing call in it.

    The decoder is a stand-in (Pillow, its pixels copied to the GPU without a sync), so this
    checks streamload's own code: geometry, resize, flips, fallbacks, labels, normalization.
    """
    from streamload._gpudecode import GpuDecoder

    device = torch.device("cuda", torch.cuda.current_device())

    def on_gpu(raws: list[np.ndarray], stream: Any) -> list[tuple[torch.Tensor, str] | None]:
        out: list[tuple[torch.Tensor, str] | None] = []
        for image in _stand_in(raws, stream):
            out.append(None if image is None else (image[0].to(device, non_blocking=True), image[1]))
        return out

    dev = DeviceDecode(32, crop="random", flip=True, device="cpu", mean=(0.5,) * 3, std=(0.5,) * 3)
    dev.device = device
    dev._gpu = GpuDecoder(device, "stand-in", on_gpu)
    ref = DeviceDecode(32, crop="random", flip=True, device="cpu", mean=(0.5,) * 3, std=(0.5,) * 3)
    for raw in _raw(mixed_images):
        torch.cuda.set_sync_debug_mode("error")
        try:
            pending = dev.start(raw)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        images, labels = dev.finish(pending)
        expect, _ = ref(raw)
        assert images.is_cuda and float((images.cpu() - expect).abs().mean()) < 0.1  # ~13 levels: DCT scaling


@pytest.fixture(scope="module")
def with_bad_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """24 samples, 4 of them JPEGs that no decoder reads (a header, then zeros)."""
    from streamload.writer import DatasetWriter

    out = tmp_path_factory.mktemp("device-bad")
    rng = np.random.default_rng(3)
    with DatasetWriter(str(out), max_samples=8) as w:
        for i in range(24):
            data = synthetic_jpeg(rng, 40 + i, 30 + i)
            if i in (3, 9, 10, 20):
                data = data[:200] + bytes(len(data) - 200)
            w.write({"__key__": f"k{i:02d}", "jpg": data, "cls": str(i % 5).encode()})
    return out


@pytest.mark.slow
def test_skip_fills_bad_slots_as_decode_batch_does(with_bad_images: Path) -> None:
    def batches(collate: Any) -> list[Any]:
        ds = StreamingDataset(
            str(with_bad_images), batch_size=6, shuffle=True, seed=4, collate=collate, on_error="skip"
        )
        return list(DataLoader(ds, batch_size=None, num_workers=2))

    ref_ds_batches = batches(DecodeBatch(20, crop="random", flip=True))
    dev = DeviceDecode(20, crop="random", flip=True, device="cpu", on_error="skip")
    got = [dev(raw) for raw in batches(RawCollate(keys=True))]
    assert len(got) == len(ref_ds_batches) > 0
    for (images, labels), (ref_images, ref_labels) in zip(got, ref_ds_batches, strict=True):
        assert torch.equal(images, ref_images) and torch.equal(labels, ref_labels)
    assert dev.skipped.value == 4 and sorted(name for name, _ in dev.skipped_samples) == ["k03", "k09", "k10", "k20"]
    assert all("cannot decode" in reason for _, reason in dev.skipped_samples)
    raising = DeviceDecode(20, device="cpu")
    with pytest.raises(SampleError, match="k03|k09|k10|k20"):
        for raw in batches(RawCollate(keys=True)):
            raising(raw)
    with pytest.raises(ConfigError, match="on_error="):
        DeviceDecode(20, device="cpu", on_error="ignore")


def test_skip_on_the_device_path_too(with_bad_images: Path) -> None:
    """The same fill through the device path's code (a CPU stand-in decoder that refuses the bad JPEGs)."""
    from streamload._gpudecode import GpuDecoder

    def refusing(raws: list[np.ndarray], stream: Any) -> list[tuple[torch.Tensor, str] | None]:
        out: list[tuple[torch.Tensor, str] | None] = []
        for raw in raws:
            try:
                array = np.asarray(Image.open(io.BytesIO(raw.tobytes())).convert("RGB")).copy()
            except OSError:
                out.append(None)
                continue
            out.append((torch.from_numpy(array), "HWC"))
        return out

    dev = DeviceDecode(20, crop="random", flip=True, device="cpu", on_error="skip", backend="pillow")
    dev._gpu = GpuDecoder(torch.device("cpu"), "stand-in", refusing)
    ref = DeviceDecode(20, crop="random", flip=True, device="cpu", on_error="skip", backend="pillow")
    ds = StreamingDataset(str(with_bad_images), batch_size=6, collate=RawCollate(keys=True))
    for raw in ds:
        images, labels = dev(raw)
        ref_images, ref_labels = ref(raw)
        assert torch.equal(labels, ref_labels)
        assert int((images.int() - ref_images.int()).abs().max()) <= 1
    assert dev.skipped.value == ref.skipped.value == 4
