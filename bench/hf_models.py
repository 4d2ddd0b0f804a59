"""Which transformers architectures rannc takes as they are: each model built from a small
config with random weights (no download), in training mode, given to rannc.plan for 4
devices and cut into 3 stages from real profiles; the stages run one after another must
equal the traced graph exactly, and the graph's outputs (loss, logits, ...) must equal the
model's (with --precision bf16, all of it under torch.autocast(device, bfloat16), within
bf16 tolerance; with --eval, in eval mode, planned for forward only, under no_grad). A
model that fails without rannc too is listed as such.

    OMP_NUM_THREADS=1 python bench/hf_models.py [--device cpu|cuda] [--precision fp32|bf16]
        [--eval] [--only gpt2,bart] [--out DIR]

A model that cannot be split into micro-batches whatever the tracer does is listed in
EXPECTED with the reason (its loss couples the rows of a batch, its shapes come from
as_strided with sizes fixed when traced, a loop runs as often as the data says); such a
model must fail with an error, and the table shows the error's first words. Writes
bench/results/hf_models.{json,md} (hf_models_cuda*, *_bf16, *_eval for the others) and exits
non-zero when a model outside EXPECTED fails. The training of a few of these under mpirun,
equal to PyTorch, is tested in tests/python/test_hf.py.
"""
import argparse
import contextlib
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(ROOT, "python")]
import torch  # noqa: E402

import rannc  # noqa: E402
from rannc.graph import SplitGraph  # noqa: E402

V, S, B = 96, 16, 4  # vocabulary, sequence length, batch


def tokens(seq=S):
    return torch.randint(3, V, (B, seq))


def causal():
    ids = tokens()
    return {"input_ids": ids, "labels": ids}


def masked():
    return {"input_ids": tokens(), "attention_mask": torch.ones(B, S, dtype=torch.long), "labels": tokens()}


def seq2seq():
    return {"input_ids": tokens(), "labels": tokens(S - 4)}


def images(size):
    return lambda: {"pixel_values": torch.randn(B, 3, size, size), "labels": torch.randint(0, 5, (B,))}


def audio():
    return {"input_values": torch.randn(B, 400), "labels": torch.randint(0, 2, (B,))}


NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
ENCODER = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
               vocab_size=V, max_position_embeddings=64, **NO_DROPOUT)
DECODER = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
               vocab_size=V, max_position_embeddings=64, use_cache=False)
BART_LIKE = dict(encoder_layers=2, decoder_layers=2, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
                 encoder_attention_heads=4, decoder_attention_heads=4, vocab_size=V,
                 max_position_embeddings=64, dropout=0.0, use_cache=False, pad_token_id=1,
                 decoder_start_token_id=2)
T5_LIKE = dict(num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, num_heads=4, d_kv=8,
               vocab_size=V, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, use_cache=False)
MOE = dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
VISION = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
              image_size=16, patch_size=4, num_labels=5, **NO_DROPOUT)
WAV = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
           conv_dim=[16, 16], conv_stride=[5, 2], conv_kernel=[10, 3], num_conv_pos_embeddings=16,
           num_conv_pos_embedding_groups=4, num_labels=2, mask_time_prob=0.0, **NO_DROPOUT)

# name: (config class, model class, config arguments, inputs)
CASES = {
    # decoders
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_layer=2, n_embd=32, n_head=4, n_positions=64,
             vocab_size=V, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False), causal),
    "gpt_neo": ("GPTNeoConfig", "GPTNeoForCausalLM", dict(num_layers=2, hidden_size=32, num_heads=4,
                vocab_size=V, max_position_embeddings=64, attention_types=[[["global", "local"], 1]],
                window_size=8, use_cache=False), causal),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(n_layer=2, n_embd=32, n_head=4, rotary_dim=4,
             vocab_size=V, n_positions=64, use_cache=False), causal),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", DECODER, causal),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(n_layer=2, n_embd=32, n_head=4,
                    vocab_size=V, n_positions=64, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
                    attn_pdrop=0.0), causal),
    "codegen": ("CodeGenConfig", "CodeGenForCausalLM", dict(n_layer=2, n_embd=32, n_head=4, rotary_dim=4,
                vocab_size=V, n_positions=64, use_cache=False), causal),
    "ctrl": ("CTRLConfig", "CTRLLMHeadModel", dict(n_layer=2, n_embd=32, n_head=4, dff=64, vocab_size=V,
             n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False), causal),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(n_layer=2, hidden_size=32, n_head=4, vocab_size=V,
              use_cache=False), causal),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(num_hidden_layers=2, hidden_size=32, ffn_dim=64,
            num_attention_heads=4, vocab_size=V, max_position_embeddings=64, word_embed_proj_dim=32,
            dropout=0.0, use_cache=False), causal),
    "xglm": ("XGLMConfig", "XGLMForCausalLM", dict(num_layers=2, d_model=32, ffn_dim=64, attention_heads=4,
             vocab_size=V, max_position_embeddings=64, dropout=0.0, use_cache=False), causal),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(DECODER, num_key_value_heads=2), causal),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(DECODER, num_key_value_heads=2), causal),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(DECODER, num_key_value_heads=2), causal),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(DECODER, num_key_value_heads=2, head_dim=8), causal),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(DECODER, num_key_value_heads=2, head_dim=8), causal),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(DECODER, num_key_value_heads=2, head_dim=8), causal),
    "phi": ("PhiConfig", "PhiForCausalLM", DECODER, causal),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(DECODER, pad_token_id=0), causal),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", DECODER, causal),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(DECODER, num_key_value_heads=2), causal),
    "falcon": ("FalconConfig", "FalconForCausalLM", DECODER, causal),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(DECODER, num_key_value_heads=2), causal),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(DECODER, num_key_value_heads=2), causal),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(DECODER, num_key_value_heads=2), causal),
    "persimmon": ("PersimmonConfig", "PersimmonForCausalLM", DECODER, causal),
    "mamba": ("MambaConfig", "MambaForCausalLM", dict(num_hidden_layers=2, hidden_size=32, vocab_size=V,
              state_size=4, expand=2, conv_kernel=4, use_cache=False), causal),
    "rwkv": ("RwkvConfig", "RwkvForCausalLM", dict(num_hidden_layers=2, hidden_size=32, vocab_size=V,
             context_length=64, attention_hidden_size=32, intermediate_size=64, use_cache=False), causal),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(DECODER, num_key_value_heads=2, head_dim=8,
               sliding_window=8), causal),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", DECODER, causal),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(DECODER, num_key_value_heads=2, pad_token_id=0),
                causal),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(DECODER, num_key_value_heads=2, head_dim=8,
             pad_token_id=0), causal),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(DECODER, num_key_value_heads=2, sliding_window=8),
                causal),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(DECODER, num_key_value_heads=2, head_dim=8),
                 causal),
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", dict(num_hidden_layers=2, hidden_size=32, vocab_size=V,
               state_size=8, expand=2, head_dim=8, num_heads=8, n_groups=1, chunk_size=8, use_cache=False),
               causal),
    "jamba": ("JambaConfig", "JambaForCausalLM", dict(
        DECODER, num_key_value_heads=2, num_experts=2, num_experts_per_tok=1, attn_layer_period=2,
        attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, mamba_d_state=4, mamba_expand=2,
        mamba_dt_rank=4, use_mamba_kernels=False), causal),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        DECODER, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, linear_num_value_heads=2,
        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention"]), causal),
    "recurrent_gemma": ("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", dict(
        DECODER, num_key_value_heads=2, lru_width=32, attention_window_size=8,
        block_types=["recurrent", "attention"]), causal),
    # mixture of experts: the grouped forms have fixed shapes; the eager loop over the
    # experts a batch hits is traced as often as the traced batch hit them
    "mixtral_batched_mm": ("MixtralConfig", "MixtralForCausalLM", dict(
        DECODER, **MOE, experts_implementation="batched_mm"), causal),
    "mixtral_grouped_mm": ("MixtralConfig", "MixtralForCausalLM", dict(
        DECODER, **MOE, experts_implementation="grouped_mm"), causal),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        DECODER, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=32, experts_implementation="batched_mm"), causal),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        DECODER, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        experts_implementation="batched_mm"), causal),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        DECODER, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, experts_implementation="batched_mm"), causal),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(
        DECODER, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2), causal),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(  # attention sinks; default experts (grouped_mm)
        DECODER, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"]), causal),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", dict(
        DECODER, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=1,
        intermediate_size_mlp=64), causal),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(  # latent attention
        DECODER, num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=8,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, experts_implementation="batched_mm"), causal),
    "switch_transformers": ("SwitchTransformersConfig", "SwitchTransformersForConditionalGeneration", dict(
        T5_LIKE, num_experts=4, expert_capacity=8, num_sparse_encoder_layers=1,
        num_sparse_decoder_layers=1), seq2seq),
    # encoders
    "bert": ("BertConfig", "BertForMaskedLM", ENCODER, masked),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", dict(ENCODER, pad_token_id=1), masked),
    "xlm_roberta": ("XLMRobertaConfig", "XLMRobertaForMaskedLM", dict(ENCODER, pad_token_id=1), masked),
    "electra": ("ElectraConfig", "ElectraForMaskedLM", dict(ENCODER, embedding_size=32), masked),
    "albert": ("AlbertConfig", "AlbertForMaskedLM", dict(ENCODER, embedding_size=16), masked),
    "deberta": ("DebertaConfig", "DebertaForMaskedLM", ENCODER, masked),
    "deberta_v2": ("DebertaV2Config", "DebertaV2ForMaskedLM", ENCODER, masked),
    "modernbert": ("ModernBertConfig", "ModernBertForMaskedLM", dict(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=V,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, sep_token_id=2,
        cls_token_id=1), masked),
    "longformer": ("LongformerConfig", "LongformerForMaskedLM", dict(ENCODER, attention_window=4,
                   pad_token_id=1), masked),
    "distilbert": ("DistilBertConfig", "DistilBertForMaskedLM", dict(n_layers=2, dim=32, hidden_dim=64,
                   n_heads=4, vocab_size=V, max_position_embeddings=64, dropout=0.0,
                   attention_dropout=0.0), masked),
    "mpnet": ("MPNetConfig", "MPNetForMaskedLM", ENCODER, masked),
    "convbert": ("ConvBertConfig", "ConvBertForMaskedLM", dict(ENCODER, embedding_size=32), masked),
    "mobilebert": ("MobileBertConfig", "MobileBertForMaskedLM", dict(
        ENCODER, embedding_size=16, intra_bottleneck_size=16, true_hidden_size=16,
        num_feedforward_networks=1), masked),
    "funnel": ("FunnelConfig", "FunnelForMaskedLM", dict(block_sizes=[1, 1], d_model=32, n_head=4, d_head=8,
               d_inner=64, vocab_size=V, hidden_dropout=0.0, attention_dropout=0.0,
               activation_dropout=0.0), masked),
    "layoutlm": ("LayoutLMConfig", "LayoutLMForMaskedLM", ENCODER, masked),
    "megatron_bert": ("MegatronBertConfig", "MegatronBertForMaskedLM", ENCODER, masked),
    "big_bird": ("BigBirdConfig", "BigBirdForMaskedLM", dict(ENCODER, attention_type="original_full"), masked),
    "xlnet": ("XLNetConfig", "XLNetLMHeadModel", dict(d_model=32, n_layer=2, n_head=4, d_inner=64,
              vocab_size=V, dropout=0.0, use_mems_train=False), causal),
    # encoder-decoders
    "t5": ("T5Config", "T5ForConditionalGeneration", T5_LIKE, seq2seq),
    "mt5": ("MT5Config", "MT5ForConditionalGeneration", T5_LIKE, seq2seq),
    "umt5": ("UMT5Config", "UMT5ForConditionalGeneration", T5_LIKE, seq2seq),
    "bart": ("BartConfig", "BartForConditionalGeneration", BART_LIKE, seq2seq),
    "mbart": ("MBartConfig", "MBartForConditionalGeneration", BART_LIKE, seq2seq),
    "pegasus": ("PegasusConfig", "PegasusForConditionalGeneration", BART_LIKE, seq2seq),
    "marian": ("MarianConfig", "MarianMTModel", BART_LIKE, seq2seq),
    "m2m100": ("M2M100Config", "M2M100ForConditionalGeneration", dict(
        BART_LIKE, encoder_layerdrop=0.0, decoder_layerdrop=0.0), seq2seq),
    "led": ("LEDConfig", "LEDForConditionalGeneration", dict(
        {k: v for k, v in BART_LIKE.items() if k != "max_position_embeddings"},
        max_encoder_position_embeddings=64, max_decoder_position_embeddings=64,
        attention_window=[4, 4]), seq2seq),
    "whisper": ("WhisperConfig", "WhisperForConditionalGeneration", dict(
        {k: v for k, v in BART_LIKE.items() if k not in ("max_position_embeddings", "pad_token_id",
                                                        "decoder_start_token_id")},
        num_mel_bins=8, max_source_positions=8, max_target_positions=32, pad_token_id=0,
        decoder_start_token_id=1),
        lambda: {"input_features": torch.randn(B, 8, 16), "labels": tokens(8)}),
    # vision and audio
    "vit": ("ViTConfig", "ViTForImageClassification", VISION, images(16)),
    "deit": ("DeiTConfig", "DeiTForImageClassification", VISION, images(16)),
    "beit": ("BeitConfig", "BeitForImageClassification", VISION, images(16)),
    "dinov2": ("Dinov2Config", "Dinov2ForImageClassification", VISION, images(16)),
    "swin": ("SwinConfig", "SwinForImageClassification", dict(
        image_size=32, patch_size=4, embed_dim=16, depths=[2, 1], num_heads=[2, 2], window_size=4,
        num_labels=5, drop_path_rate=0.0, **NO_DROPOUT), images(32)),
    "convnext": ("ConvNextConfig", "ConvNextForImageClassification", dict(
        hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=5), images(32)),
    "resnet": ("ResNetConfig", "ResNetForImageClassification", dict(
        hidden_sizes=[8, 16], depths=[1, 1], embedding_size=8, num_labels=5), images(32)),
    "regnet": ("RegNetConfig", "RegNetForImageClassification", dict(
        hidden_sizes=[8, 16], depths=[1, 1], embedding_size=8, groups_width=8, num_labels=5), images(32)),
    "segformer": ("SegformerConfig", "SegformerForImageClassification", dict(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], patch_sizes=[7, 3],
        strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2], num_labels=5), images(32)),
    "mobilevit": ("MobileViTConfig", "MobileViTForImageClassification", dict(
        image_size=32, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64],
        num_labels=5), images(32)),
    "wav2vec2": ("Wav2Vec2Config", "Wav2Vec2ForSequenceClassification", dict(WAV, layerdrop=0.0), audio),
    "hubert": ("HubertConfig", "HubertForSequenceClassification", WAV, audio),
    "clip": ("CLIPConfig", "CLIPModel", dict(
        text_config=dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                         vocab_size=V, max_position_embeddings=32),
        vision_config=dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                           num_attention_heads=4, image_size=16, patch_size=4), projection_dim=16),
        lambda: {"input_ids": tokens(), "pixel_values": torch.randn(B, 3, 16, 16), "return_loss": True}),
}

# Models that no trace can split into micro-batches, with the reason and the start of the
# error they must fail with.
EXPECTED = {
    "clip": ("its contrastive loss compares every row of the batch with every other, so a "
             "micro-batch's loss is not a part of the batch's", "batch size is baked into a shape"),
    "hubert": ("its LayerDrop (layerdrop=0.1, as in its config's default) skips a layer when a "
               "random number says so, in Python; with layerdrop=0.0 it runs (as wav2vec2 does here)",
               "decides in Python on a random number"),
    "led": ("Longformer's sliding windows call as_strided with sizes the trace fixes",
            "batch size is baked into a shape"),
    "longformer": ("its sliding windows call as_strided with sizes the trace fixes",
                   "batch size is baked into a shape"),
    "switch_transformers": ("its experts loop over the experts the batch hits; it has no fixed-shape "
                            "form (Mixtral, Qwen2-MoE and OLMoE do: experts_implementation)",
                            "running op aten::unbind"),
}


def check(name, device, precision="fp32", training=True):
    import transformers as tf
    cfg_cls, model_cls, cfg, inputs = CASES[name]
    torch.manual_seed(0)
    model = getattr(tf, model_cls)(getattr(tf, cfg_cls)(**cfg)).to(device)
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs().items()}
    model.train(training)
    with contextlib.ExitStack() as stack:
        tolerance = {}
        if precision == "bf16":  # traced, planned and compared under the user's autocast
            stack.enter_context(torch.autocast(device, dtype=torch.bfloat16))
            tolerance = dict(rtol=1.6e-2, atol=1e-2)
        if not training:  # an evaluation: planned forward only, run without autograd
            stack.enter_context(torch.no_grad())
        return _check(model, kwargs, device, tolerance, training)


class PlainPyTorchFails(Exception):
    """The model fails without rannc too (a transformers bug under this configuration)."""


def _outputs(out):
    """The floating tensors a transformers ModelOutput (or a tuple) holds."""
    leaves = out.to_tuple() if hasattr(out, "to_tuple") else out
    return [t for t in torch.utils._pytree.tree_leaves(leaves)
            if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _check(model, kwargs, device, tolerance, training):
    torch.manual_seed(2)
    try:
        ref = model(**kwargs)
    except Exception as e:
        raise PlainPyTorchFails(f"{type(e).__name__}: {e}") from None
    plan = rannc.plan(model, (), kwargs, world_size=4, devices_per_node=4, device_memory="1GiB",
                      num_stages=3, profile_warmup=0, profile_repetitions=1, profile_device=device,
                      training=training)
    torch.manual_seed(2)
    out = plan.graph(**kwargs)
    torch.manual_seed(2)
    chained = SplitGraph(plan.graph, plan.stage_pieces())(**kwargs)  # the stages one after another
    for a, b in zip(_outputs(out), _outputs(chained)):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    mine, theirs = _outputs(out), _outputs(ref)
    assert len(mine) == len(theirs), f"{len(mine)} outputs, the model {len(theirs)}"
    for a, b in zip(mine, theirs):  # the loss, the logits, and what else the model returns
        torch.testing.assert_close(a, b, **tolerance)
    return plan.graph.ir.num_tasks


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--only", default="", help="comma-separated names (default: all)")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                    help="bf16: under torch.autocast(device, bfloat16), losses within bf16 tolerance")
    ap.add_argument("--eval", action="store_true", help="the models in eval mode, planned for "
                    "forward only (training=False) and run under no_grad")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args()
    import transformers as tf
    tf.logging.set_verbosity_error()
    torch.set_num_threads(1)
    if a.device == "cuda":  # fp32 against fp32: no TF32 in matmuls and convolutions
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    names = [n for n in a.only.split(",") if n] or list(CASES)
    rows = []
    for name in names:
        t0 = time.perf_counter()
        try:
            tasks = check(name, a.device, a.precision, training=not a.eval)
            status, detail = "ok", f"{tasks} tasks"
        except PlainPyTorchFails as e:
            status, detail = "fails in PyTorch", " ".join(str(e).split())[:300]
        except Exception as e:  # the table records what failed and why
            first = " ".join(str(e).split())[:300]
            expected = EXPECTED.get(name)
            status = "expected error" if expected and expected[1] in first else "FAILED"
            detail = f"{type(e).__name__}: {first}"
        rows.append(dict(model=name, status=status, seconds=round(time.perf_counter() - t0, 2),
                         detail=detail, reason=EXPECTED.get(name, ("",))[0]))
        print(f"{status:15s} {name:20s} {rows[-1]['seconds']:6.1f} s  {detail[:160]}", flush=True)
    suffix = (("" if a.device == "cpu" else f"_{a.device}") + ("" if a.precision == "fp32" else f"_{a.precision}")
              + ("_eval" if a.eval else ""))
    os.makedirs(a.out, exist_ok=True)
    meta = dict(device=a.device, precision=a.precision, eval=a.eval, torch=torch.__version__,
                transformers=tf.__version__)
    with open(os.path.join(a.out, f"hf_models{suffix}.json"), "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)
    ok = sum(r["status"] == "ok" for r in rows)  # EXPECTED may run in eval (no LayerDrop there)
    failed = [r["model"] for r in rows if r["status"] not in ("ok", "expected error", "fails in PyTorch")]
    lines = [f"# transformers models through rannc ({a.device}, {a.precision}, {'eval' if a.eval else 'training'}, "
             f"torch {meta['torch']}, "
             f"transformers {meta['transformers']}; `bench/hf_models.py`)", "",
             "Small configs, random weights; rannc.plan for 4 devices into 3 stages from real "
             "profiles; the chained stages equal the traced graph exactly and its outputs (loss, "
             "logits, ...) equal the model's.", "",
             f"{ok} of {len(rows)} ok; failed outside the expected: {', '.join(failed) or 'none'}.", "",
             "| model | result | s | detail |", "|---|---|---|---|"]
    for r in rows:
        detail = r["detail"] if r["status"] != "expected error" else f"{r['reason']}: {r['detail'][:120]}..."
        lines.append(f"| {r['model']} | {r['status']} | {r['seconds']} | {detail.replace('|', '/')} |")
    with open(os.path.join(a.out, f"hf_models{suffix}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"{ok} of {len(rows)} ok; failed outside the expected: {', '.join(failed) or 'none'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
