"""The Kimi-dims DFlash drafter both A/B scripts build, written out here because the base tree (8cfe6cf) has no
k26jax.step_cost.kimi_drafter_config. Import after the tree under test is on sys.path."""


def kimi_drafter(cfg, tiny: bool = False):
    """6 layers, 64 / 8 heads at 7168 (tiny: 2 layers, 8 heads at cfg's width); target layers clamped to cfg's."""
    from k26jax.config import DrafterConfig, build_target_layer_ids

    dims = dict(
        hidden_size=7168,
        num_hidden_layers=6,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=18432,
        num_target_layers=61,
        rope_theta=50000.0,
    )
    if tiny:
        dims.update(hidden_size=cfg.hidden_size, num_attention_heads=8, head_dim=32, intermediate_size=512)
        dims.update(num_hidden_layers=2)
    ids = [min(i, cfg.num_hidden_layers - 1) for i in build_target_layer_ids(61, dims["num_hidden_layers"])]
    return DrafterConfig.from_dict(
        dict(
            dims,
            rms_norm_eps=1e-6,
            block_size=8,
            vocab_size=cfg.vocab_size,
            max_position_embeddings=cfg.max_position_embeddings,
            dflash_config=dict(target_layer_ids=ids, mask_token_id=cfg.vocab_size - 2),
        )
    )
