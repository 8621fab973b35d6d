"""Modality specs and processors, checked against real cv2/numpy/gymnasium/minigrid and hand-computed numbers."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
import typing
from pathlib import Path

import cv2
import gymnasium as gym
import numpy as np
import pytest

from cluster import config as C
from cluster.config import ConfigError
from pipeline import contract
from pipeline.contract import conflicts, specs_from
from pipeline.modality import (
    CorruptObservation,
    EncodedImage,
    ModalitySpec,
    ObservationError,
    build_vocab,
    make_processor,
)

ROOT = Path(__file__).resolve().parents[1]


def _png(rgb: np.ndarray) -> bytes:
    """Encode an RGB (or grayscale) frame the way an env would: cv2 expects BGR order."""
    frame = cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR) if rgb.ndim == 3 and rgb.shape[2] == 3 else rgb
    ok, buf = cv2.imencode(".png", frame)
    assert ok
    return buf.tobytes()


def _rgb(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)


# ---------------------------------------------------------------------------------------------------- images


def test_png_round_trip_is_exact_for_every_bytes_like_input():
    rgb = _rgb(8, 10)
    proc = make_processor(ModalitySpec("camera", "image", encoding="png"), EncodedImage((8, 10, 3)))
    data = _png(rgb)
    assert proc.out_shape == (8, 10, 3) and proc.out_dtype == np.uint8
    for raw in (data, bytearray(data), memoryview(data), np.frombuffer(data, np.uint8)):
        out = proc(raw)
        assert out.dtype == np.uint8
        np.testing.assert_array_equal(out, rgb)  # PNG is lossless and the channel order comes back as RGB


def test_png_grayscale_keeps_a_channel_axis():
    gray = np.random.default_rng(1).integers(0, 256, size=(6, 5), dtype=np.uint8)
    proc = make_processor(ModalitySpec("depth", "image", encoding="png"), EncodedImage((6, 5, 1)))
    out = proc(_png(gray))
    assert out.shape == (6, 5, 1)
    np.testing.assert_array_equal(out[:, :, 0], gray)


def test_png_resize_averages_blocks_with_inter_area():
    # Constant 2x2 blocks: halving each side with INTER_AREA must give back exactly the block values.
    blocks = _rgb(4, 5, seed=2)
    big = np.repeat(np.repeat(blocks, 2, axis=0), 2, axis=1)  # (8, 10, 3)
    proc = make_processor(ModalitySpec("camera", "image", encoding="png", size=(4, 5)), EncodedImage((8, 10, 3)))
    assert proc.out_shape == (4, 5, 3)
    out = proc(_png(big))
    assert out.shape == (4, 5, 3) and out.dtype == np.uint8
    np.testing.assert_array_equal(out, blocks)
    batch = proc.batch([_png(big), _png(big[::-1].copy())])
    assert batch.shape == (2, 4, 5, 3) and batch.dtype == np.uint8
    np.testing.assert_array_equal(batch[1], blocks[::-1])


def test_raw_uint8_frames_pass_through_and_resize():
    space = gym.spaces.Box(0, 255, (8, 10, 3), np.uint8)
    plain = make_processor(ModalitySpec("camera", "image"), space)
    frame = _rgb(8, 10, seed=3)
    np.testing.assert_array_equal(plain(frame), frame)
    resized = make_processor(ModalitySpec("camera", "image", size=(4, 5)), space)
    big = np.repeat(np.repeat(frame[:4, :5], 2, axis=0), 2, axis=1)
    np.testing.assert_array_equal(resized(big), frame[:4, :5])


def test_grayscale_is_bt601_luma_before_the_resize():
    rgb = np.array([[[255, 0, 0], [0, 255, 0], [0, 0, 255]],
                    [[255, 255, 255], [10, 20, 30], [100, 150, 200]]], dtype=np.uint8)
    # round(0.299 R + 0.587 G + 0.114 B): 76.2, 149.7, 29.1 / 255, 18.2, 140.8
    luma = np.array([[76, 150, 29], [255, 18, 141]], dtype=np.uint8)[:, :, None]
    raw = make_processor(ModalitySpec("camera", "image", grayscale=True), gym.spaces.Box(0, 255, (2, 3, 3), np.uint8))
    assert raw.out_shape == (2, 3, 1)
    np.testing.assert_array_equal(raw(rgb), luma)
    png = make_processor(ModalitySpec("camera", "image", encoding="png", grayscale=True), EncodedImage((2, 3, 3)))
    np.testing.assert_array_equal(png.batch([_png(rgb)]), luma[None])
    # Resized after the conversion: 2x2 blocks of one colour average back to that colour's luma.
    resized = make_processor(ModalitySpec("camera", "image", grayscale=True, size=(2, 3)),
                             gym.spaces.Box(0, 255, (4, 6, 3), np.uint8))
    np.testing.assert_array_equal(resized(np.repeat(np.repeat(rgb, 2, axis=0), 2, axis=1)), luma)
    rgba = np.concatenate([rgb, np.full((2, 3, 1), 7, np.uint8)], axis=2)  # alpha is dropped
    rgba_proc = make_processor(ModalitySpec("camera", "image", grayscale=True),
                               gym.spaces.Box(0, 255, (2, 3, 4), np.uint8))
    np.testing.assert_array_equal(rgba_proc(rgba), luma)
    gray = make_processor(ModalitySpec("depth", "image", grayscale=True), gym.spaces.Box(0, 255, (2, 3), np.uint8))
    np.testing.assert_array_equal(gray(luma[:, :, 0]), luma)  # already one channel: unchanged
    assert C.from_dict({"env": {"modalities": {"camera": {"kind": "image", "grayscale": True}}}}) \
        .env.modalities["camera"].grayscale is True


def test_jpeg_decodes_to_the_declared_shape_and_roughly_the_pixels():
    # A smooth gradient survives JPEG with small errors; the exact values are the codec's business.
    y, x = np.mgrid[0:16, 0:24]
    rgb = np.stack([x * 10, y * 15, np.full_like(x, 128)], axis=-1).astype(np.uint8)
    ok, buf = cv2.imencode(".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, 95])
    assert ok
    proc = make_processor(ModalitySpec("camera", "image", encoding="jpeg"), EncodedImage((16, 24, 3), "jpeg"))
    out = proc(buf.tobytes())
    assert out.shape == (16, 24, 3) and out.dtype == np.uint8
    assert np.abs(out.astype(int) - rgb.astype(int)).mean() < 4  # and not channel-swapped (B=128 vs R=x*10)


@pytest.mark.parametrize("raw", [b"not an image at all", _png(_rgb(8, 8))[:20], b""])
def test_bytes_that_do_not_decode_raise_corrupt_observation(raw):
    proc = make_processor(ModalitySpec("camera", "image", encoding="png"), EncodedImage((8, 8, 3)))
    with pytest.raises(CorruptObservation, match=r"observation 'camera' \(image\).*do not decode"):
        proc(raw)
    assert issubclass(CorruptObservation, ObservationError)


def test_wrong_decoded_shape_names_modality_expected_and_received():
    proc = make_processor(ModalitySpec("camera", "image", encoding="png"), EncodedImage((16, 16, 3)))
    with pytest.raises(ObservationError) as info:
        proc(_png(_rgb(8, 8)))
    message = str(info.value)
    assert not isinstance(info.value, CorruptObservation)  # it decoded fine; it is the wrong frame
    assert "'camera'" in message and "(16, 16, 3)" in message and "(8, 8, 3)" in message
    assert "\n" not in message


def test_raw_image_of_wrong_dtype_and_shape_gives_the_one_line_message():
    proc = make_processor(ModalitySpec("camera", "image"), gym.spaces.Box(0, 255, (16, 16, 3), np.uint8))
    with pytest.raises(ObservationError) as info:
        proc(np.zeros((16, 16)))
    assert str(info.value) == (
        "observation 'camera' (image): expected uint8 array of shape (16, 16, 3), "
        "received float64 array of shape (16, 16)"
    )
    with pytest.raises(ObservationError, match="received str$"):
        proc("a frame")


def test_encoded_image_bytes_of_the_wrong_type_are_rejected():
    proc = make_processor(ModalitySpec("camera", "image", encoding="png"), EncodedImage((8, 8, 3)))
    with pytest.raises(ObservationError, match="received str$"):
        proc("\x89PNG")
    with pytest.raises(ObservationError, match="received int32 array of shape"):
        proc(np.frombuffer(_png(_rgb(8, 8)), np.uint8).astype(np.int32))


def test_image_setup_errors():
    with pytest.raises(ObservationError, match=r"'camera' \(image\).*Discrete"):
        make_processor(ModalitySpec("camera", "image"), gym.spaces.Discrete(3))
    with pytest.raises(ObservationError, match=r"declare `encoding: png` in env.modalities.camera"):
        make_processor(ModalitySpec("camera", "image"), EncodedImage((8, 8, 3)))
    with pytest.raises(ObservationError, match="needs an EncodedImage"):
        make_processor(ModalitySpec("camera", "image", encoding="png"), gym.spaces.Box(0, 255, (8, 8, 3), np.uint8))
    with pytest.raises(ObservationError, match="uint8 Box"):
        make_processor(ModalitySpec("camera", "image"), gym.spaces.Box(0, 1, (8, 8, 3), np.float32))


def test_an_integer_board_within_0_255_is_an_image_cast_to_uint8():
    """A board game's int8 planes (PettingZoo classic: Box(0, 1, (6, 7, 2), int8)) go through the image path as
    uint8 (so the small-image convs can read them); integers outside 0..255 stay a setup error."""
    proc = make_processor(ModalitySpec("board", "image", scale=1.0), gym.spaces.Box(0, 1, (6, 7, 2), np.int8))
    board = np.zeros((6, 7, 2), np.int8)
    board[5, 3, 0] = board[5, 4, 1] = 1
    out = proc(board)
    assert out.dtype == np.uint8 and out.shape == (6, 7, 2) and np.array_equal(out, board.astype(np.uint8))
    with pytest.raises(ObservationError, match=r"expected int8 array of shape \(6, 7, 2\)"):
        proc(board.astype(np.uint8))
    with pytest.raises(ObservationError, match=r"integers within 0..255"):
        make_processor(ModalitySpec("board", "image"), gym.spaces.Box(-1, 1, (6, 7, 2), np.int8))


def test_encoded_image_space_sample_and_contains():
    space = EncodedImage((6, 7, 3), "png", seed=0)
    frame = space.sample()
    assert space.contains(frame) and space.contains(np.frombuffer(frame, np.uint8))
    assert cv2.imdecode(np.frombuffer(frame, np.uint8), cv2.IMREAD_COLOR).shape == (6, 7, 3)
    assert not space.contains(b"\xff\xd8\xff")  # a JPEG is not this space's encoding
    assert not space.contains("\x89PNG") and not space.contains(np.zeros(8, np.int64))
    jpeg = EncodedImage((6, 7, 3), "jpeg", seed=0)
    assert jpeg.contains(jpeg.sample())
    assert space == EncodedImage((6, 7, 3)) and space != jpeg
    with pytest.raises(ValueError):
        EncodedImage((6, 7, 4), "jpeg")


# ---------------------------------------------------------------------------------------------------- text

VOCAB = ["go", "to", "the", "red", "ball"]  # sorted ids: ball=2, go=3, red=4, the=5, to=6 (0 pad, 1 unknown)


def _text(max_tokens: int = 8):
    return make_processor(ModalitySpec("mission", "text", max_tokens=max_tokens, vocab=tuple(VOCAB)),
                          gym.spaces.Text(64))


def test_text_ids_padding_and_case_and_punctuation():
    proc = _text()
    assert proc.vocab_size == 7 and proc.out_shape == (8,) and proc.out_dtype == np.int64
    out = proc("Go to the RED ball!")
    assert out.dtype == np.int64
    np.testing.assert_array_equal(out, [3, 6, 5, 4, 2, 0, 0, 0])


def test_text_truncation_and_unknown_words():
    np.testing.assert_array_equal(_text(max_tokens=3)("go to the red ball"), [3, 6, 5])
    np.testing.assert_array_equal(_text()("go to the blue key, now"), [3, 6, 5, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(_text()(""), np.zeros(8))


def test_text_cache_hands_out_copies_and_batch_matches_calls():
    proc = _text()
    first = proc("go to the ball")
    first[:] = 99  # a consumer scribbling on its array must not change what the next step gets
    np.testing.assert_array_equal(proc("go to the ball"), [3, 6, 5, 2, 0, 0, 0, 0])
    missions = ["go to the ball", "the red ball", "go to the ball"]
    np.testing.assert_array_equal(proc.batch(missions), np.stack([proc(m) for m in missions]))
    restored = pickle.loads(pickle.dumps(proc))  # processors may cross process boundaries with Ray
    np.testing.assert_array_equal(restored("the red ball"), [5, 4, 2, 0, 0, 0, 0, 0])


def test_text_rejects_non_strings():
    with pytest.raises(ObservationError, match=r"^observation 'mission' \(text\): expected str, received int$"):
        _text()(3)


def test_build_vocab_on_the_real_minigrid_fetch_mission_space():
    import minigrid

    gym.register_envs(minigrid)  # importing registers the MiniGrid envs; this names the import's purpose

    env = gym.make("MiniGrid-Fetch-5x5-N2-v0")
    space = env.observation_space["mission"]
    env.close()
    vocab = build_vocab(space)
    assert {"fetch", "purple", "ball", "you", "must"} <= set(vocab)
    assert len(vocab) == len(set(vocab)) and vocab == sorted(vocab)
    # Built without a declared vocabulary, every mission the env can say tokenises without unknown words.
    proc = make_processor(ModalitySpec("mission", "text", max_tokens=8), space)
    space.seed(0)
    ids = proc.batch([space.sample() for _ in range(50)])
    assert (ids != 1).all() and (ids[:, 0] >= 2).all()


def test_build_vocab_without_placeholders_and_setup_errors():
    from minigrid.core.mission import MissionSpace

    assert build_vocab(MissionSpace(mission_func=lambda: "Get the ball.")) == ["ball", "get", "the"]
    with pytest.raises(ObservationError, match=r"'mission' \(text\).*declare `vocab` in env.modalities.mission"):
        make_processor(ModalitySpec("mission", "text"), gym.spaces.Text(32))
    with pytest.raises(ObservationError, match="string-valued"):
        make_processor(ModalitySpec("mission", "text", vocab=("a",)), gym.spaces.Discrete(3))


# ---------------------------------------------------------------------------------------------------- vectors


def test_box_vectors_are_validated_and_cast_to_float32():
    proc = make_processor(ModalitySpec("joints", "vector"), gym.spaces.Box(-1, 1, (4,), np.float64))
    out = proc(np.array([0.5, -1.0, 2.0, 3.0]))
    assert out.dtype == np.float32 and out.shape == (4,)
    np.testing.assert_array_equal(out, [0.5, -1.0, 2.0, 3.0])  # no normalisation here
    np.testing.assert_array_equal(proc([1, 2, 3, 4]), [1, 2, 3, 4])
    batch = proc.batch([np.arange(4.0), np.ones(4)])
    assert batch.dtype == np.float32
    np.testing.assert_array_equal(batch, [[0, 1, 2, 3], [1, 1, 1, 1]])


def test_box_vector_errors_name_shape_and_dtype():
    proc = make_processor(ModalitySpec("joints", "vector"), gym.spaces.Box(-1, 1, (4,), np.float32))
    with pytest.raises(ObservationError) as info:
        proc(np.zeros((1, 4)))
    assert str(info.value) == ("observation 'joints' (vector): expected numeric array of shape (4,), "
                               "received float64 array of shape (1, 4)")
    with pytest.raises(ObservationError, match="received <U1 array of shape"):
        proc(np.array(["a", "b", "c", "d"]))
    with pytest.raises(ObservationError, match="received list of shape \\(3,\\)$"):
        proc([1.0, 2.0, 3.0])
    with pytest.raises(ObservationError, match="received str$"):
        proc("1234")


def test_discrete_becomes_one_hot():
    proc = make_processor(ModalitySpec("direction", "vector"), gym.spaces.Discrete(4))
    assert proc.out_shape == (4,) and proc.out_dtype == np.float32
    np.testing.assert_array_equal(proc(2), [0, 0, 1, 0])
    np.testing.assert_array_equal(proc(np.int64(0)), [1, 0, 0, 0])
    np.testing.assert_array_equal(proc.batch([3, np.array(1), 0]), [[0, 0, 0, 1], [0, 1, 0, 0], [1, 0, 0, 0]])
    with pytest.raises(ObservationError, match=r"expected int in \[0, 4\), received int 4$"):
        proc(4)
    with pytest.raises(ObservationError, match="received bool"):
        proc(True)
    shifted = make_processor(ModalitySpec("floor", "vector"), gym.spaces.Discrete(3, start=-1))
    np.testing.assert_array_equal(shifted(-1), [1, 0, 0])


def test_categorical_ids_are_checked_against_their_channels_counts():
    """minigrid's symbolic view: object, colour and state ids per cell. Ids pass as they are (the model one-hots
    them); one outside its channel's count, negative or fractional is an error naming where it is."""
    spec = ModalitySpec("image", "vector", categories=(11, 6, 3))
    proc = make_processor(spec, gym.spaces.Box(0, 255, (3, 3, 3), np.uint8))
    view = np.zeros((3, 3, 3), np.uint8)
    view[..., 0], view[..., 1], view[..., 2] = 10, 5, 2  # the largest id of each channel
    np.testing.assert_array_equal(proc(view), view)
    np.testing.assert_array_equal(proc.batch([view, view * 0]), [view, view * 0])
    bad = view.copy()
    bad[2, 1, 1] = 6  # a colour id past the 6 colours
    with pytest.raises(ObservationError) as info:
        proc.batch([view, bad])
    assert str(info.value) == ("observation 'image' (vector): expected integer ids in [0, [11, 6, 3]) per channel "
                               "(categories), received np.float32(6.0) at index [1, 2, 1, 1]")
    floats = make_processor(ModalitySpec("cells", "vector", categories=(4,)), gym.spaces.Box(-9, 9, (2,)))
    np.testing.assert_array_equal(floats(np.array([3.0, 0.0])), [3, 0])
    for value in ([0.5, 1.0], [-1.0, 0.0], [4.0, 0.0]):
        with pytest.raises(ObservationError, match="integer ids in"):
            floats(np.array(value))


def test_categories_that_cannot_describe_the_key_are_setup_errors():
    box = gym.spaces.Box(0, 255, (3, 3, 3), np.uint8)
    with pytest.raises(ObservationError, match=r"categories has 2 entries and the value's last axis \(shape "
                                               r"\(3, 3, 3\)\) has 3 channels.*env.modalities.image.categories"):
        make_processor(ModalitySpec("image", "vector", categories=(11, 6)), box)
    with pytest.raises(ObservationError, match="one-hot already"):
        make_processor(ModalitySpec("direction", "vector", categories=(4,)), gym.spaces.Discrete(4))
    assert list(conflicts(ModalitySpec("camera", "image", categories=(11,)))) == [
        ("categories", "[11] with kind image: only vector modalities hold ids; allowed: null, or kind: vector")]


# ---------------------------------------------------------------------------------------------------- point clouds


def _cloud(num_points: int = 4, **kwargs):
    spec = ModalitySpec("lidar", "pointcloud", num_points=num_points, **kwargs)
    return make_processor(spec, gym.spaces.Box(-np.inf, np.inf, (128, 3), np.float32), seed=7)


def test_pointcloud_subsamples_distinct_points_reproducibly():
    raw = np.arange(30, dtype=np.float32).reshape(10, 3)  # row i is (3i, 3i+1, 3i+2): identifiable
    out = _cloud(4)(raw)
    assert out.shape == (4, 3) and out.dtype == np.float32
    rows = (out[:, 0] / 3).astype(int)
    assert len(set(rows)) == 4  # without replacement
    np.testing.assert_array_equal(out, raw[rows])
    np.testing.assert_array_equal(_cloud(4)(raw), out)  # same seed, same draw


def test_pointcloud_repeats_points_when_short_and_zeros_when_empty():
    raw = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=np.float64)
    out = _cloud(7)(raw)
    np.testing.assert_array_equal(out, raw[[0, 1, 2, 0, 1, 2, 0]])
    np.testing.assert_array_equal(_cloud(5)(np.zeros((0, 3))), np.zeros((5, 3)))
    np.testing.assert_array_equal(_cloud(3)(raw), raw)


def test_pointcloud_center_then_scale():
    raw = np.array([[0, 0, 0], [2, 0, 0], [0, 4, 0], [2, 4, 6]], dtype=np.float32)  # centroid (1, 2, 1.5)
    out = _cloud(4, center=True, point_scale=2.0)(raw)
    expected = [[-0.5, -1, -0.75], [0.5, -1, -0.75], [-0.5, 1, -0.75], [0.5, 1, 2.25]]
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-6)
    # The centroid is the full cloud's, not the subsample's: every subsample is shifted by the same (1, 2, 1.5).
    sub = _cloud(2, center=True)(raw)
    assert sub.shape == (2, 3)
    assert all(np.isclose(raw, row + [1, 2, 1.5]).all(axis=-1).any() for row in sub)
    np.testing.assert_array_equal(raw[3], [2, 4, 6])  # the caller's array is untouched


def test_pointcloud_rejects_non_finite_and_wrong_shapes():
    proc = _cloud(4)
    with pytest.raises(ObservationError, match=r"'lidar' \(pointcloud\).*with 2 non-finite values"):
        proc(np.array([[0, np.nan, 0], [np.inf, 0, 0]]))
    with pytest.raises(ObservationError, match=r"received float64 array of shape \(5, 2\)"):
        proc(np.zeros((5, 2)))
    with pytest.raises(ObservationError, match=r"Box of shape \(M, 3\)"):
        make_processor(ModalitySpec("lidar", "pointcloud"), gym.spaces.Box(0, 1, (8, 2)))


# ---------------------------------------------------------------------------------------------------- audio


def _reference_spectrogram(wave: np.ndarray, n_fft: int, hop: int) -> np.ndarray:
    """Frame by frame, float64, periodic Hann written out: the textbook definition."""
    window = np.array([0.5 - 0.5 * np.cos(2 * np.pi * k / n_fft) for k in range(n_fft)])
    rows = []
    start = 0
    while start + n_fft <= len(wave):
        rows.append(np.log(1 + np.abs(np.fft.rfft(window * wave[start:start + n_fft].astype(np.float64)))))
        start += hop
    return np.array(rows)


def test_audio_matches_the_per_frame_reference_and_batch_matches_calls():
    spec = ModalitySpec("mic", "audio", n_fft=64, hop=32)
    proc = make_processor(spec, gym.spaces.Box(-1, 1, (200,), np.float32))
    assert proc.out_shape == (5, 33)  # 1 + (200 - 64) // 32 = 5 frames, 64 // 2 + 1 = 33 bins
    rng = np.random.default_rng(0)
    waves = [rng.uniform(-1, 1, 200).astype(np.float32) for _ in range(3)]
    out = proc(waves[0])
    assert out.dtype == np.float32 and out.shape == (5, 33)
    np.testing.assert_allclose(out, _reference_spectrogram(waves[0], 64, 32), rtol=1e-5, atol=1e-5)
    batch = proc.batch(waves)
    assert batch.shape == (3, 5, 33) and batch.dtype == np.float32
    np.testing.assert_allclose(batch, np.stack([proc(w) for w in waves]), rtol=1e-6, atol=1e-6)


def test_audio_tone_peaks_at_its_bin():
    proc = make_processor(ModalitySpec("mic", "audio", n_fft=64, hop=16), gym.spaces.Box(-1, 1, (128,)))
    tone = np.sin(2 * np.pi * 8 * np.arange(128) / 64).astype(np.float32)  # exactly bin 8
    assert (proc(tone).argmax(axis=-1) == 8).all()


def test_audio_setup_and_value_errors():
    with pytest.raises(ObservationError, match=r"'mic' \(audio\).*32 samples are shorter than n_fft=64"):
        make_processor(ModalitySpec("mic", "audio"), gym.spaces.Box(-1, 1, (32,)))
    proc = make_processor(ModalitySpec("mic", "audio"), gym.spaces.Box(-1, 1, (100,)))
    with pytest.raises(ObservationError, match=r"expected numeric array of shape \(100,\), received float32 array"):
        proc(np.zeros((99,), np.float32))


# ---------------------------------------------------------------------------------------------------- the spec


def test_due_and_staleness_for_each_rate():
    step = ModalitySpec("camera", "image")
    assert step.is_fast and all(step.due(t) for t in range(5)) and step.staleness_bound is None
    every = ModalitySpec("lidar", "pointcloud", rate="every", every=3)
    assert not every.is_fast
    assert [every.due(t) for t in range(7)] == [True, False, False, True, False, False, True]
    assert every.staleness_bound == 2
    assert ModalitySpec("lidar", "pointcloud", rate="every", every=3, max_staleness=5).staleness_bound == 5
    reset = ModalitySpec("mission", "text", rate="reset")
    assert [reset.due(t) for t in range(3)] == [True, False, False] and reset.staleness_bound is None


def test_from_dict_stores_yaml_lists_as_tuples_and_fills_defaults():
    spec = ModalitySpec.from_dict(
        "camera", {"kind": "image", "encoding": "png", "size": [32, 48], "budget_ms": 3.0, "vocab": ["a", "b"]}
    )
    assert spec.size == (32, 48) and spec.vocab == ("a", "b") and spec.budget_ms == 3.0
    assert spec.name == "camera" and spec.rate == "step" and spec.max_tokens == 16 and spec.on_corrupt == "fail"
    assert hash(spec) == hash(ModalitySpec("camera", "image", encoding="png", size=(32, 48), budget_ms=3.0,
                                           vocab=("a", "b")))
    assert ModalitySpec.from_dict("mic", {}).kind == "vector"  # the config's default, the same field
    assert pickle.loads(pickle.dumps(spec)).name == "camera"  # Ray ships spec objects to rollout actors
    with pytest.raises(ValueError, match=r"env.modalities.camera: unknown key\(s\) colour; allowed keys here: kind"):
        ModalitySpec.from_dict("camera", {"kind": "image", "colour": True})


def test_specs_from_names_spec_objects_and_converts_plain_data_once():
    loaded = C.from_dict({"env": {"modalities": {"camera": {"kind": "image", "size": [4, 5]},
                                                 "lidar": {"kind": "pointcloud", "rate": "every", "every": 4}}}})
    as_objects = specs_from(loaded.env.modalities)  # what the driver could pass (cfg.env.modalities)
    as_dicts = specs_from(loaded.to_dict()["env"]["modalities"])  # what it passes today (cfg.to_dict())
    assert [s.name for s in as_objects] == [s.name for s in as_dicts] == ["camera", "lidar"]
    assert as_objects == as_dicts and as_objects[1].staleness_bound == 3
    assert as_objects[0] is not loaded.env.modalities["camera"] and loaded.env.modalities["camera"].name == ""


def test_the_config_validates_the_contract_fields_and_their_conflicts():
    """Type, range and choice checks come from the contract's metadata, run by the config loader (once)."""
    def error(modality: dict) -> str:
        with pytest.raises(ConfigError) as exc:
            C.from_dict({"env": {"modalities": {"camera": modality}}})
        return str(exc.value)

    assert error({"kind": "video"}).startswith("env.modalities.camera.kind: 'video' is not allowed; allowed: image")
    assert error({"rate": "sometimes"}).startswith("env.modalities.camera.rate: 'sometimes' is not allowed")
    assert error({"encoding": "webp"}).startswith("env.modalities.camera.encoding: 'webp' is not allowed")
    assert error({"on_corrupt": "ignore"}).startswith("env.modalities.camera.on_corrupt: 'ignore' is not allowed")
    assert error({"center": "false"}).startswith("env.modalities.camera.center: 'false' is not a boolean")
    assert error({"colour": True}).startswith("env.modalities.camera.colour: unknown key")
    assert error({"size": [32]}).startswith("env.modalities.camera.size: [32] is not [height, width]")
    assert error({"rate": "every", "every": 1}).startswith("env.modalities.camera.every: 1 with rate: every")
    assert error({"kind": "audio", "n_fft": 16, "hop": 32}).startswith("env.modalities.camera.hop: 32 is larger")
    assert [field for field, _ in conflicts(ModalitySpec("x", rate="every", every=4, max_staleness=1))] == \
        ["max_staleness"]


def test_one_dataclass_is_the_config_entry_and_the_pipeline_spec():
    assert typing.get_type_hints(C.EnvConfig)["modalities"] == typing.Dict[str, contract.ModalitySpec]
    assert ModalitySpec is contract.ModalitySpec  # pipeline.modality re-exports it
    # The configuration reference's rows (docs/configuration.md) for env.modalities.<key> are this dataclass's fields, one each.
    rows = [line for line in C.markdown_table().splitlines() if line.startswith("| `env.modalities.<key>.")]
    assert [r.split("`")[1].rsplit(".", 1)[1] for r in rows] == [f.name for f in dataclasses.fields(ModalitySpec)]


def test_the_contract_imports_neither_torch_nor_cv2_nor_numpy():
    code = "import sys, pipeline.contract; print(sorted({'torch', 'cv2', 'numpy', 'cluster'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    imported = {line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines() if "|" in line}
    assert "pipeline.contract" in imported and not {"torch", "cv2", "numpy"} & imported
