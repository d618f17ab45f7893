#!/usr/bin/env python3
"""Train the lily-tiny byte-level BPE tokenizer and tokenize the corpus.

Reads ``train.jsonl`` / ``heldout.jsonl`` written by build_corpus.py. The BPE is
trained on the training split only. Its pipeline has the shape of the Qwen
tokenizers: NFC normalizer, a regex Split pre-tokenizer followed by a
ByteLevel pre-tokenizer (no regex of its own), a plain BPE model (no unk token,
no byte fallback) and a ByteLevel decoder. 8187 learned tokens (256 bytes +
merges) are followed by 5 added tokens:

    8187 <|endoftext|>  special (document separator, pad)
    8188 <|im_start|>   special
    8189 <|im_end|>     special (end of turn, eos)
    8190 <think>        not special
    8191 </think>       not special

Writes, in --tokenizer-dir: tokenizer.json, tokenizer_config.json (with a
ChatML chat_template), generation_config.json. With --data-dir also writes
train.npy / heldout.npy (uint16 token ids): every document followed by
<|endoftext|>, training documents in a fixed shuffled order (seed 0).

With --tokenizer FILE no BPE is trained: the streams are made with that
tokenizer.json (e.g. the shipped src/lily/models/lily-tiny/tokenizer.json, for
training the MTP head on exactly the ids the model sees) and nothing is written
to --tokenizer-dir.

Usage:
    python3 tools/lily_tiny/build_tokenizer.py --corpus-dir .tiny_work/corpus \
        --tokenizer-dir .tiny_work/tokenizer --data-dir .tiny_work/data
    python3 tools/lily_tiny/build_tokenizer.py --corpus-dir .tiny_work/corpus \
        --tokenizer src/lily/models/lily-tiny/tokenizer.json --data-dir .tiny_work/data
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

VOCAB_SIZE = 8192
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
NON_SPECIAL_ADDED = ["<think>", "</think>"]
ADDED = SPECIAL + NON_SPECIAL_ADDED
LEARNED = VOCAB_SIZE - len(ADDED)

# Contractions, letters (with one leading non-letter), single digits, punctuation runs, newlines, spaces.
PRETOKENIZE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def build(train_texts) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=LEARNED,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )

    def strip_added(texts):
        for t in texts:
            for s in ADDED:
                t = t.replace(s, "\n")
            yield t

    tok.train_from_iterator(strip_added(train_texts), trainer=trainer)
    assert tok.get_vocab_size() == LEARNED, tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in NON_SPECIAL_ADDED])
    for i, s in enumerate(ADDED):
        assert tok.token_to_id(s) == LEARNED + i, (s, tok.token_to_id(s))
    assert tok.get_vocab_size() == VOCAB_SIZE
    return tok


def write_configs(out_dir: str):
    ids = {s: LEARNED + i for i, s in enumerate(ADDED)}
    added_decoder = {
        str(ids[s]): {
            "content": s,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": s in SPECIAL,
        }
        for s in ADDED
    }
    cfg = {
        "add_prefix_space": False,
        "added_tokens_decoder": added_decoder,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 8192,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
        f.write("\n")
    gen = {
        "bos_token_id": None,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "do_sample": True,
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.8,
    }
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
        f.write("\n")


def encode_docs(tok: Tokenizer, texts) -> np.ndarray:
    eot = tok.token_to_id("<|endoftext|>")
    out = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        out.extend(enc.ids)
        out.append(eot)
    return np.asarray(out, dtype=np.uint16)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus-dir", required=True)
    ap.add_argument("--tokenizer-dir", help="where the trained tokenizer and configs go")
    ap.add_argument("--tokenizer", help="an existing tokenizer.json to tokenize with (no BPE training)")
    ap.add_argument("--data-dir")
    args = ap.parse_args()
    if bool(args.tokenizer) == bool(args.tokenizer_dir):
        ap.error("give exactly one of --tokenizer-dir (train the BPE) and --tokenizer (use an existing one)")
    if args.tokenizer and not args.data_dir:
        ap.error("--tokenizer only tokenizes: --data-dir is required with it")

    train = read_jsonl(os.path.join(args.corpus_dir, "train.jsonl"))
    heldout = read_jsonl(os.path.join(args.corpus_dir, "heldout.jsonl"))
    if args.tokenizer:
        tok = Tokenizer.from_file(args.tokenizer)
        for i, s in enumerate(ADDED):
            if tok.token_to_id(s) != LEARNED + i:
                raise SystemExit(f"--tokenizer {args.tokenizer}: {s} is not id {LEARNED + i}")
        tok_file = args.tokenizer
    else:
        tok = build([d["text"] for d in train])
        os.makedirs(args.tokenizer_dir, exist_ok=True)
        tok_file = os.path.join(args.tokenizer_dir, "tokenizer.json")
        tok.save(tok_file)
        write_configs(args.tokenizer_dir)
    with open(tok_file, "rb") as f:
        print("tokenizer.json sha256", hashlib.sha256(f.read()).hexdigest())

    if args.data_dir:
        os.makedirs(args.data_dir, exist_ok=True)
        order = np.random.default_rng(0).permutation(len(train))
        train_ids = encode_docs(tok, [train[i]["text"] for i in order])
        held_ids = encode_docs(tok, [d["text"] for d in heldout])
        # The held-out stream must equal the tokenized heldout.txt (documents joined by <|endoftext|>).
        joined = tok.encode("<|endoftext|>".join(d["text"] for d in heldout), add_special_tokens=False).ids
        assert joined + [tok.token_to_id("<|endoftext|>")] == held_ids.tolist()
        np.save(os.path.join(args.data_dir, "train.npy"), train_ids)
        np.save(os.path.join(args.data_dir, "heldout.npy"), held_ids)
        chars = sum(len(d["text"]) for d in train)
        print(
            f"train tokens {len(train_ids):,} ({chars / len(train_ids):.2f} chars/token), "
            f"heldout tokens {len(held_ids):,}"
        )


if __name__ == "__main__":
    main()
