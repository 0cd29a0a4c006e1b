"""The translation pipeline: `pipeline(model=folder, trust_remote_code=True)("Open file")`.

transformers 5 removed its `translation` and `text2text-generation` tasks, so the Deriv translation
model ships this small `Pipeline` under a task name of its own, `deriv-translation`. Exported
folders carry it (`custom_pipelines` in config.json, this file beside the model code), so it works
for users who do not have this package.
"""

from transformers import Pipeline


TASK = "deriv-translation"


class DerivTranslationPipeline(Pipeline):
    """Source text in, `[{"translation_text": ...}]` out; generation options pass through to `generate()`.

    Sources longer than the model's `max_position_embeddings` are truncated to it (a warning says so).
    """

    _load_processor = False
    _load_image_processor = False
    _load_feature_extractor = False
    _load_tokenizer = True

    def _sanitize_parameters(self, truncation=True, **generate_kwargs):
        return {"truncation": truncation}, generate_kwargs, {}

    def preprocess(self, text: str, truncation: bool = True):
        if not isinstance(text, str):
            raise TypeError(f"{TASK} translates strings, got {type(text).__name__}")
        limit = self.model.config.max_position_embeddings
        inputs = self.tokenizer(text, return_tensors="pt")
        if inputs["input_ids"].shape[1] > limit:
            if not truncation:
                raise ValueError(
                    f"The source is {inputs['input_ids'].shape[1]} tokens long; the model reads at most {limit}."
                )
            inputs = {k: v[:, :limit] for k, v in inputs.items()}
        return inputs

    def _forward(self, model_inputs, **generate_kwargs):
        # subtle: generate returns num_return_sequences rows per source; group them per source, so that the
        # pipeline's batching (which splits outputs along the first dimension) keeps each source's rows together
        output_ids = self.model.generate(**model_inputs, **generate_kwargs)
        sources = model_inputs["input_ids"].shape[0]
        return {"output_ids": output_ids.reshape(sources, -1, output_ids.shape[-1])}

    def postprocess(self, model_outputs):
        texts = self.tokenizer.batch_decode(model_outputs["output_ids"][0], skip_special_tokens=True)
        return [{"translation_text": text.strip()} for text in texts]


__all__ = ["TASK", "DerivTranslationPipeline"]
