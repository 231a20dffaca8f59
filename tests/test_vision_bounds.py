"""What one row, or one batch, of a vision chat job may cost: every bound is checked from the images' headers before
any pixel is decoded, and the rows that pass are decoded one bounded group of images at a time.

Memory is the peak resident size (``resource.getrusage``) of a fresh subprocess, compared between a small call and a
larger one; images are flat-colour PNGs, a few kilobytes each however many pixels they hold. An image whose header
reads but whose pixels cannot be decoded (``undecodable``) shows what was never decoded: a row refused with a bound's
message, not "cannot be opened", was refused before its pixels were touched.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
from PIL import Image  # noqa: E402

from test_vision import folders, png, processor, text  # noqa: E402,F401 - the shared processor fixtures
from test_vision_images import chat, encoded, photo, png_header  # noqa: E402
from test_vision_video import data_url, video_chat  # noqa: E402

from lossmask import hf  # noqa: E402
from lossmask.chat.media import image_size, load_processor, pan_and_scan_crops, processor_images  # noqa: E402

PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_max_num_crops": 100000, "pan_and_scan_min_crop_size": 8}


def refusals(proc, rows, **options):
    """``(rows kept, the invalid rows' messages)`` of ``hf.mask_dataset`` over ``rows`` (messages, images)."""
    ds = datasets.Dataset.from_dict({"messages": [m for m, _ in rows], "images": [i for _, i in rows]})
    _, report = hf.mask_dataset(ds, proc, return_report=True, quiet=True, max_drop_fraction=1.0, **options)
    return report.rows_out, report.invalid_examples


def undecodable(width, height) -> bytes:
    """``png_header``'s image with its pixel data broken: its header reads, its pixels never decode."""
    data = png_header(width, height)
    at = data.index(b"IDAT") + 4
    return data[:at] + b"\xff\xff" + data[at + 2:]


def image_chat(n):
    return [{"role": "user", "content": [{"type": "image"}] * n + [text("What are they?")]},
            {"role": "assistant", "content": [text("Squares.")]}]


PEAK = textwrap.dedent("""
    import io, json, resource, sys
    import datasets
    from PIL import Image
    from lossmask import hf
    from lossmask.chat.media import load_processor

    folder, side, rows, parts, kwargs = sys.argv[1], *map(int, sys.argv[2:5]), json.loads(sys.argv[5])
    buffer = io.BytesIO()
    Image.new("RGB", (side, side), (30, 200, 30)).save(buffer, format="PNG")
    flat = buffer.getvalue()
    chat = [{"role": "user", "content": [{"type": "image"}] * parts + [{"type": "text", "text": "What?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "A square."}]}]
    ds = datasets.Dataset.from_dict({"messages": [chat] * rows, "images": [[flat] * parts] * rows})
    _, report = hf.mask_dataset(ds, load_processor(folder), return_report=True, quiet=True, max_drop_fraction=1.0,
                                **kwargs)
    print(json.dumps([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, report.rows_out]))
""")


def peak(folder, side, rows, parts=1, **options):
    """``(peak resident MB, rows kept)`` of a fresh subprocess that labels one batch of ``rows`` rows of ``parts``
    images each, a flat ``side`` x ``side`` PNG (one ``hf.mask_dataset`` call: each call adds to the peak by itself)."""
    done = subprocess.run([sys.executable, "-c", PEAK, str(folder), str(side), str(rows), str(parts),
                           json.dumps(options)], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_peak_memory_for_a_batch_of_large_images_does_not_grow_with_the_batch_size(folders):
    """Twelve rows of a 16-megapixel image cost what two rows cost: each image is decoded in its group, just before the
    processor's call (which shrinks it here, so that the decoded pixels are what is measured), and let go after it.
    Decoded all at once, the ten more images added 1.1 GB."""
    small = {"size": {"shortest_edge": 3136, "longest_edge": 200704}}
    two, kept_two = peak(folders["qwen2-vl"], 4000, 2, processor_kwargs=small)
    twelve, kept_twelve = peak(folders["qwen2-vl"], 4000, 12, processor_kwargs=small)
    assert (kept_two, kept_twelve) == (2, 12)
    assert twelve - two < 150, f"peak {two} MB for 2 rows, {twelve} MB for 12"


def test_a_row_with_many_image_parts_costs_no_memory_before_it_is_refused(folders):
    """Thirty 16-megapixel images in one row make 491,520 image tokens: the row is refused from their headers, so it
    costs what a one-image row refused by a lower bound costs (decoded first, the thirty added 1.8 GB)."""
    one, kept_one = peak(folders["qwen2-vl"], 4000, 1, max_media_tokens=1000)
    thirty, kept_thirty = peak(folders["qwen2-vl"], 4000, 1, 30)
    assert (kept_one, kept_thirty) == (0, 0)
    assert thirty - one < 150, f"peak {one} MB for a row of one image, {thirty} MB for a row of thirty"


def test_a_row_whose_images_pass_the_token_bound_is_refused_before_any_is_decoded(folders):
    proc = processor(folders, "qwen2-vl")
    kept, examples = refusals(proc, [(image_chat(30), [undecodable(4000, 4000)] * 30),
                                     (chat(), [encoded(photo(64, 48))])])
    assert kept == 1 and len(examples) == 1
    assert "row 0: its images make 491,520 image tokens, over max_media_tokens=65,536" in examples[0]


def test_an_image_that_cannot_be_decoded_refuses_its_row_alone(folders):
    """The rows that pass are decoded after the checks, several rows' images to a group: an image whose pixels are
    cut short refuses its own row, named, and the rows around it are labelled."""
    proc = processor(folders, "qwen2-vl")
    good = encoded(photo(64, 48))
    kept, examples = refusals(proc, [(image_chat(2), [good, good]), (image_chat(2), [good, undecodable(64, 64)]),
                                     (chat(), [good])])
    assert kept == 2 and len(examples) == 1
    assert "row 1: image 1 cannot be opened" in examples[0]


def test_pan_and_scan_with_a_huge_crop_count_is_refused_before_the_crops_are_made(folders):
    """transformers' count for Gemma-3 leaves pan-and-scan out (256 per image): lossmask adds the crops. A 20000x60
    image cut into crops of 8 pixels and up makes 333 crops, 334 x 256 image tokens (decoded and cropped, it took
    14 s and 3.4 GB before the count after the image step refused it)."""
    proc = processor(folders, "gemma-3")
    kept, examples = refusals(proc, [(chat(), [undecodable(20000, 60)])], processor_kwargs=PAN_AND_SCAN)
    assert kept == 0
    assert "row 0: its images make 85,504 image tokens, over max_media_tokens=65,536" in examples[0]


@pytest.mark.parametrize("settings", [{}, {"pan_and_scan_min_crop_size": 8, "pan_and_scan_max_num_crops": 6},
                                      {"pan_and_scan_min_ratio_to_activate": 2.5, "pan_and_scan_min_crop_size": 100}])
def test_pan_and_scan_crops_are_counted_as_the_processor_makes_them(folders, settings):
    proc = processor(folders, "gemma-3")
    kwargs = {"do_pan_and_scan": True, **settings}
    sizes = [(300, 300), (400, 600), (600, 400), (60, 2000), (2000, 60), (100, 290), (256, 700), (90, 1000)]
    features, _ = processor_images(proc, [Image.new("RGB", (w, h)) for h, w in sizes], **kwargs)
    assert pan_and_scan_crops(proc, sizes, kwargs) == [int(n) for n in features["num_crops"]]
    assert pan_and_scan_crops(proc, sizes, {}) == [0] * len(sizes)  # the processor's default: no pan-and-scan


def test_an_image_the_processor_cannot_count_is_still_bounded_from_its_pixels(folders):
    """A processor with no count from sizes: a 7000x7000 image (under max_image_pixels) is reckoned at one token per
    14x14 pixels, 250,000, and refused before it is decoded; a small one is not."""
    proc = load_processor(folders["qwen2-vl"])
    proc._get_num_multimodal_tokens = None  # the processor here cannot count its tokens from sizes
    kept, examples = refusals(proc, [(chat(), [undecodable(7000, 7000)]), (chat(), [encoded(photo(64, 48))])])
    assert kept == 1
    assert "row 0: its images make 250,000 image tokens, over max_media_tokens=65,536 (an upper bound" in examples[0]


def test_many_huge_video_frames_are_refused_before_they_are_decoded_and_reading_stops_at_the_bound(folders):
    """Two hundred 6000x6000 frames make 1,638,400 video tokens; the frames' sizes come from their headers, and reading
    stops once the row passes the bound: the broken frame 150 is never reached (decoded, they took 30 s)."""
    proc = processor(folders, "qwen2-vl")
    frames = [data_url(undecodable(6000, 6000))] * 200
    frames[150] = "data:image/png;base64,AAAA"
    ds = datasets.Dataset.from_list([{"messages": video_chat(frames)},
                                     {"messages": video_chat([data_url(png(64, 48))] * 2)}])
    _, report = hf.mask_dataset(ds, proc, return_report=True, quiet=True, max_drop_fraction=1.0)
    assert report.rows_out == 1
    message = report.invalid_examples[0]
    assert "row 0: its images and videos make" in message and "over max_media_tokens=65,536 (at least" in message


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_an_images_size_is_read_from_its_header_as_its_orientation_turns_it(tmp_path, orientation):
    """The size the bounds are checked against is the turned image's, as ``open_image`` gives it, for paths and bytes
    alike; nothing is decoded (the header-only PNG would fail)."""
    data = encoded(photo(60, 20), "JPEG", orientation=orientation)
    turned = (20, 60) if orientation in (6, 8) else (60, 20)
    (tmp_path / "a.jpg").write_bytes(data)
    assert image_size(data, index=0) == image_size("a.jpg", index=0, media_dir=str(tmp_path)) == turned
    assert image_size(undecodable(4000, 3000), index=0) == (4000, 3000)
    assert image_size(Image.open(io.BytesIO(data)), index=0) == (60, 20)  # a PIL image given is taken as it is

