package gputest

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestSummarizeMatchesCrefStatistic(t *testing.T) {
	summary := func(perOp []float64) [2]float64 {
		m, l := Summarize(perOp)
		return [2]float64{m, l}
	}
	perOp := []float64{1000} // the warm-up batch, left out
	for i := range 15 {
		perOp = append(perOp, float64(100+i)) // median 107
	}
	assert.Equal(t, [2]float64{107, 0}, summary(perOp), "16 batches: measured, late")
	perOp = append(perOp, 300, 200, 500)
	assert.Equal(t, [2]float64{107, 300}, summary(perOp), "19 batches: measured, late")
	assert.Equal(t, [2]float64{101, 0}, summary(perOp[:3]), "3 batches: measured, late")
	assert.Equal(t, [2]float64{0, 0}, summary(perOp[:1]), "the warm-up batch alone: nothing measured")
}
